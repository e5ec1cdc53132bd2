"""``make train-vlm`` as the Ctrl-C line tells a user to rerun it (issue 39): ``RESUME=auto`` reaches
``vlm.train`` as ``--resume auto``, ``ARGS`` as its overrides, and the line names exactly that make command.
make runs for real, with ``PY`` a script that records what it was given instead of training."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from vlm.config.train import REPO_ROOT
from vlm.train import RERUN_ENV, parse_args, resume_command

RECORDER = """#!/bin/sh
{python} -c 'import json, os, sys; print(json.dumps({{"argv": sys.argv[1:], "rerun": os.environ.get("{env}")}}))' "$@"
"""


def make_train_vlm(tmp: Path, *words: str) -> dict:
    """What ``make train-vlm WORDS`` runs: vlm.train's arguments and the rerun command it exports."""
    py = tmp / "py"
    py.write_text(RECORDER.format(python=sys.executable, env=RERUN_ENV))
    py.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in (RERUN_ENV, "MAKEFLAGS", "MFLAGS")}
    out = subprocess.run(["make", "-s", "-C", str(REPO_ROOT), "train-vlm", *words, f"PY={py}", "DATA_STAMP="],
                         capture_output=True, text=True, check=True, env=env, timeout=60).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["argv"][:2] == ["-m", "vlm.train"], got
    return {"args": parse_args(got["argv"][2:]), "rerun": got["rerun"]}


def test_resume_auto_reaches_vlm_train(tmp_path):
    plain = make_train_vlm(tmp_path)
    assert (plain["args"].resume, plain["args"].config, plain["args"].overrides) == \
        (None, "configs/train/default.yaml", [])
    resumed = make_train_vlm(tmp_path, "RESUME=auto")
    assert resumed["args"].resume == "auto"
    other = make_train_vlm(tmp_path, "CONFIG=configs/train/full.yaml", "ARGS=train.lr=1e-3 name=x", "RESUME=auto")
    assert (other["args"].config, other["args"].overrides, other["args"].resume) == \
        ("configs/train/full.yaml", ["train.lr=1e-3", "name=x"], "auto")


@pytest.mark.parametrize("words", [[], ["CONFIG=configs/train/full.yaml", "ARGS=train.lr=1e-3 name=x"]])
def test_the_ctrl_c_command_resumes_the_same_run(words, tmp_path, monkeypatch):
    """The command the interrupt line names (``resume_command`` under make's environment), typed as is,
    runs vlm.train with the same config and overrides and ``--resume auto``."""
    first = make_train_vlm(tmp_path, *words)
    monkeypatch.setenv(RERUN_ENV, first["rerun"])
    command = shlex.split(resume_command(first["args"]))
    assert command[:2] == ["make", "train-vlm"] and command[-1] == "RESUME=auto", command
    again = make_train_vlm(tmp_path, *command[2:])
    assert (again["args"].config, again["args"].overrides, again["args"].resume) == \
        (first["args"].config, first["args"].overrides, "auto")


def test_without_make_the_command_is_this_process_with_resume_auto(monkeypatch):
    monkeypatch.delenv(RERUN_ENV, raising=False)
    args = parse_args(["--config", "configs/train/default.yaml", "name=a b", "--no-eval"])
    words = shlex.split(resume_command(args))
    assert words[1:] == ["-m", "vlm.train", "--config", "configs/train/default.yaml", "--no-eval", "name=a b",
                         "--resume", "auto"]
    assert Path(words[0]).resolve() == Path(sys.executable).resolve()
