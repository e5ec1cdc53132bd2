"""Helpers for the training tests: the tiny configs of ``vlm.reliability.runs`` plus launching
``vlm.train`` in a subprocess and training in this process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from vlm.reliability.runs import (  # noqa: F401
    TINY_LM,
    TINY_VLM,
    clean_env,
    config,
    records,
    write_config,
)
from torch.distributed.elastic.utils.distributed import get_free_port
from vlm.config.train import REPO_ROOT


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every descendant: torchrun starts each worker in a session
    of its own, out of reach of the group kill, and a worker left alive holds the output pipe open."""
    import psutil  # a DeepSpeed dependency

    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        kids = []
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for kid in kids:
        try:
            kid.kill()
        except psutil.NoSuchProcess:
            pass


def launch(config_path: Path, nproc: int = 1, args=(), timeout: float = 300, launcher: str = "torchrun",
           env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``vlm.train`` in a subprocess: ``python -m vlm.train`` (nproc=1, launcher='python'),
    ``torchrun --standalone`` or the ``deepspeed`` launcher. On timeout the launcher and all its
    workers are killed (``kill_tree``), and the captured output is attached to the raised error."""
    py = sys.executable
    module = "vlm.reliability.train" if (env or {}).get("VLM_TRAIN_FAULT") else "vlm.train"  # faults: its entry
    if launcher == "python":
        cmd = [py, "-m", module]
    elif launcher == "torchrun":
        cmd = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", module]
    elif launcher == "deepspeed":
        cmd = [py, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port", str(get_free_port()),
               "--module", module]
    else:
        raise ValueError(launcher)
    cmd += ["--config", str(config_path), *args]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env or clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        raise TimeoutError(f"{' '.join(cmd)} timed out after {timeout}s (hang?):\n{out[-6000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def losses(run_dir: Path, key: str = "loss") -> dict[int, float]:
    """step -> value of ``key`` in the training records (a later line for the same step wins)."""
    return {int(r["step"]): r.get(key) for r in records(run_dir)}


def fit_inprocess(cfg, resume: str | None = None, callbacks=None, finish: bool = False):
    """Build a Trainer for a loaded ``cfg`` in this process (world size 1, gloo), fit (and finish), close.
    Returns the Trainer; the process's torch thread count is put back (cpu_threads is process-wide)."""
    import torch

    from vlm.training.trainer import Trainer

    threads = torch.get_num_threads()
    try:
        trainer = Trainer(cfg, resume=resume, callbacks=callbacks)
        try:
            trainer.fit()
            if finish:
                trainer.finish()
        finally:
            trainer.close()
    finally:
        torch.set_num_threads(threads)  # cpu_threads is process-wide: leave other tests as they were
    return trainer


def run_inprocess(raw: dict, tmp: Path, resume: str | None = None, finish: bool = False, faults=None,
                  extra_callbacks=()):
    """Train in this process (world size 1, gloo). Returns the Trainer. ``extra_callbacks`` run before
    the default ones (as ``vlm.train.main``'s)."""
    from vlm.config.train import load_train_config

    cfg = load_train_config(write_config(tmp, raw, f"{raw['name']}.yaml"))
    callbacks = None
    if faults or extra_callbacks:  # the reliability entry point's seam (vlm/reliability/train.py)
        from vlm.reliability.faults import InjectFaults
        from vlm.training.callbacks.defaults import default_callbacks

        callbacks = [*([InjectFaults(faults)] if faults else []), *extra_callbacks, *default_callbacks()]
    return fit_inprocess(cfg, resume, callbacks, finish)
