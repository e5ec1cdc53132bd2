"""``python -m vlm.train`` as a user meets it: the commands its ``--help`` shows run under their launchers
(checked by the launchers' own parsers), and bad input is one line, exit 2, before anything heavy."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest
from _launchers import parse_launch

from vlm.config.train import REPO_ROOT, load_train_config
from vlm.train import parse_args

PLACEHOLDERS = {"C": "configs/train/default.yaml"}  # the help's config placeholder


def help_commands(capsys) -> list[str]:
    """The command lines of ``--help`` (indented, comments dropped)."""
    with pytest.raises(SystemExit) as exc:
        parse_args(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    return [line.split("#")[0].strip() for line in text.splitlines()
            if line.startswith("    ") and line.split()[0] in ("python", "torchrun", "deepspeed")]


def test_help_commands_parse_under_their_launchers(capsys, monkeypatch):
    """Each launcher line of the help is accepted by that launcher's real parser (deepspeed's runner,
    torchrun's), launches vlm.train (the module, or the script file that exists), and vlm.train accepts
    its arguments with the config in place of C."""
    lines = help_commands(capsys)
    assert {line.split()[0] for line in lines} == {"python", "torchrun", "deepspeed"}, lines
    monkeypatch.chdir(REPO_ROOT)
    for line in lines:
        argv = [PLACEHOLDERS.get(word, word) for word in shlex.split(line)]
        launch = parse_launch(argv)
        if launch.is_module:
            assert launch.target == "vlm.train", line
        else:
            assert Path(launch.target).resolve() == (REPO_ROOT / "vlm" / "train.py").resolve(), line
        args = parse_args(launch.args)
        assert args.config == PLACEHOLDERS["C"], line
        load_train_config(args.config, args.overrides)


def test_launcher_check_refuses_what_the_launcher_refuses():
    """The check is the launcher's own: deepspeed has no -m (issue 33), torchrun has no --num_gpus."""
    from _launchers import LauncherError

    with pytest.raises(LauncherError, match="unrecognized arguments: -m"):
        parse_launch(shlex.split("deepspeed --num_gpus 8 -m vlm.train --config C"))
    with pytest.raises(LauncherError, match="num_gpus"):
        parse_launch(shlex.split("torchrun --num_gpus 2 -m vlm.train --config C"))
    launch = parse_launch(shlex.split("HF_HUB_OFFLINE=1 deepspeed --num_gpus 8 --module vlm.train --config C a=1"))
    assert (launch.launcher, launch.target, launch.is_module, launch.args) == \
        ("deepspeed", "vlm.train", True, ["--config", "C", "a=1"])
    assert sys.modules.get("deepspeed") is not None
