"""Tiny training runs for driving ``vlm.train`` from outside: small LM / VLM configs (synthetic
data, fp32 on CPU), writing them as YAML, a clean environment for the subprocess, and reading
back its metrics. Used by the reliability suite and by the training tests."""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import yaml

from vlm.modeling.config_base import deep_merge
from vlm.config.train import REPO_ROOT

# torch.distributed / launcher variables a run in this process may have set, and the fault plan
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
            "ROLE_RANK", "TORCHELASTIC_RUN_ID", "VLM_TRAIN_FAULT")

TINY_LM = {
    "name": "tiny-lm",
    "seed": 0,
    "deepspeed": "zero2",
    "cpu_threads": 1,
    "model": {"kind": "lm", "preset": "configs/model/tiny_concept.yaml"},
    "data": {"kind": "synthetic", "max_length": 32, "synthetic_vocab": 64},
    "train": {"max_steps": 6, "micro_batch_size": 4, "lr": 3.0e-3, "warmup_steps": 1, "grad_clip": 1.0},
    "log": {"every_steps": 1, "progress_bar": False, "tensorboard": False},
    "checkpoint": {"every_steps": 3, "keep_last": 3, "export_hf": False},
}

TINY_VLM = deep_merge(TINY_LM, {
    "name": "tiny-vlm",
    "model": {"kind": "vlm", "preset": "configs/model/vlm_tiny.yaml"},
    "data": {"max_length": 40},
})


def config(out_dir: Path, base: dict = TINY_LM, **sections) -> dict:
    """``base`` with ``output_dir=out_dir`` and ``sections`` merged in: a dict value is merged into
    that section (``train={"max_steps": 3}``), anything else replaces the key (``name="x"``)."""
    raw = deep_merge(copy.deepcopy(base), {"output_dir": str(out_dir)})
    for key, val in sections.items():
        raw = deep_merge(raw, {key: val}) if isinstance(val, dict) else {**raw, key: val}
    return raw


def write_config(out_dir: Path, raw: dict, name: str = "train.yaml") -> Path:
    path = Path(out_dir) / name
    path.write_text(yaml.safe_dump(raw))
    return path


def clean_env(**extra) -> dict:
    """The current environment without torch.distributed variables and ``VLM_TRAIN_FAULT`` (an
    in-process run set them for its own process group), one OpenMP thread unless set, the repo on
    PYTHONPATH, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def records(run_dir: Path) -> list[dict]:
    """The training records of ``<run_dir>/metrics.jsonl`` (periodic eval lines left out)."""
    path = Path(run_dir) / "metrics.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in recs if "loss" in r]


def live_records(run_dir: Path) -> list[dict]:
    """``records`` of a run that may still be writing: no file yet gives [], and a line being
    written right now (not yet valid JSON) is left out."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "loss" in rec:
            out.append(rec)
    return out
