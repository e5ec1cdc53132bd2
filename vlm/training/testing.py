"""Helpers for the training tests (tiny configs, in-process runs, launcher subprocesses).

Kept in the package (not under tests/) so every training test file can share them.
"""
from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from vlm.training.distributed import free_port
from vlm.training.train_config import REPO_ROOT, deep_merge

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


def config(tmp: Path, base: dict = TINY_LM, **sections) -> dict:
    raw = deep_merge(copy.deepcopy(base), {"output_dir": str(tmp)})
    for key, val in sections.items():
        raw = deep_merge(raw, {key: val}) if isinstance(val, dict) else {**raw, key: val}
    return raw


def write_config(tmp: Path, raw: dict, name: str = "train.yaml") -> Path:
    path = Path(tmp) / name
    path.write_text(yaml.safe_dump(raw))
    return path


def clean_env(**extra) -> dict:
    """The current environment without torch.distributed variables (an in-process test run set
    them for its own process group) plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def launch(config_path: Path, nproc: int = 1, args=(), timeout: float = 300, launcher: str = "torchrun",
           env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``vlm.train`` in a subprocess: ``python -m vlm.train`` (nproc=1, launcher='python'),
    ``torchrun --standalone`` or the ``deepspeed`` launcher. The whole process group is killed on
    timeout, and the captured output is attached to the raised error."""
    py = sys.executable
    if launcher == "python":
        cmd = [py, "-m", "vlm.train"]
    elif launcher == "torchrun":
        cmd = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "vlm.train"]
    elif launcher == "deepspeed":
        cmd = [py, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port", str(free_port()),
               "--module", "vlm.train"]
    else:
        raise ValueError(launcher)
    cmd += ["--config", str(config_path), *args]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env or clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise TimeoutError(f"{' '.join(cmd)} timed out after {timeout}s (hang?):\n{out[-6000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def losses(run_dir: Path, key: str = "loss") -> dict[int, float]:
    """step -> value from metrics.jsonl (a later line for the same step wins)."""
    out = {}
    path = Path(run_dir) / "metrics.jsonl"
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if "loss" in rec:  # training records (eval records carry eval_* keys only)
                out[int(rec["step"])] = rec.get(key)
    return out


def records(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in recs if "loss" in r]


def run_inprocess(raw: dict, tmp: Path, resume: str | None = None, finish: bool = False):
    """Train in this process (world size 1, gloo). Returns the Trainer."""
    import torch

    from vlm.training.train_config import load_train_config
    from vlm.training.trainer import Trainer

    cfg = load_train_config(write_config(tmp, raw, f"{raw['name']}.yaml"))
    threads = torch.get_num_threads()
    try:
        trainer = Trainer(cfg, resume=resume)
        try:
            trainer.fit()
            if finish:
                trainer.finish()
        finally:
            trainer.close()
    finally:
        torch.set_num_threads(threads)  # cpu_threads is process-wide: leave other tests as they were
    return trainer
