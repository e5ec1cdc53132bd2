"""Background training runs for the fault cases: launch, watch progress, kill one rank, compare the
final weights with an uninterrupted run. Every case trains the same 2-process ZeRO-2 CPU run of the
tiny VLM, so one reference run serves all of them."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from vlm.reliability import runs
from vlm.training import checkpoint as ckpt
from vlm.reliability.faults import ENV
from torch.distributed.elastic.utils.distributed import get_free_port
from vlm.config.train import REPO_ROOT

STEPS = 30          # optimizer steps per run
CKPT_EVERY = 5      # checkpoint interval (steps); keep_last 2
TOL = 1e-6          # fp32: resumed runs must reproduce the reference to this (max |diff|)


def fault_config(work: Path, name: str, **sections) -> Path:
    """Write the shared 2-process ZeRO-2 tiny-VLM config for run ``name`` under ``work``."""
    raw = runs.config(work, base=runs.TINY_VLM, name=name, deepspeed="zero2",
                      train={"max_steps": STEPS, "micro_batch_size": 4, "grad_accum": 1},
                      log={"every_steps": 1, "progress_bar": False, "tensorboard": False},
                      checkpoint={"every_steps": CKPT_EVERY, "keep_last": 2, "export_hf": True},
                      eval={"vqa_json": None})
    raw = runs.config(work, base=raw, **sections)
    return runs.write_config(work, raw, f"{name}.yaml")


class Run:
    """One training run in the background: ``torchrun`` (2 workers under its agent) or ``manual``
    (2 bare processes with RANK/WORLD_SIZE set, as on two nodes whose launchers do not watch each
    other). Output goes to ``<work>/<name>.<attempt>.log`` (manual: one log per rank)."""

    def __init__(self, config: Path, nproc: int = 2, launcher: str = "torchrun", resume: str | None = None,
                 fault: str | None = None):
        self.config, self.nproc, self.launcher = Path(config), nproc, launcher
        raw = yaml.safe_load(self.config.read_text())
        self.run_dir = Path(raw["output_dir"]) / raw["name"]
        self.ckpt_dir = self.run_dir / "ckpt"
        args = ["--config", str(self.config)] + (["--resume", resume] if resume else [])
        env = runs.clean_env(**({ENV: fault} if fault else {}))
        module = "vlm.reliability.train" if fault else "vlm.train"  # the fault plan's entry point
        attempt = len(list(self.config.parent.glob(f"{raw['name']}.*.log")))
        self.logs: list[Path] = []
        self.procs: list[subprocess.Popen] = []
        py = sys.executable
        if launcher == "torchrun":
            cmd = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", module]
            self._spawn(cmd + args, env, self.config.parent / f"{raw['name']}.{attempt}.log")
        elif launcher == "manual":
            port = str(get_free_port())
            for rank in range(nproc):
                renv = {**env, "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
                        "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
                self._spawn([py, "-m", module, *args], renv,
                            self.config.parent / f"{raw['name']}.{attempt}.rank{rank}.log")
        else:
            raise ValueError(launcher)
        self.t0 = time.monotonic()

    def _spawn(self, cmd, env, log: Path) -> None:
        f = open(log, "w", encoding="utf-8")  # noqa: SIM115 - closed with the process (see wait)
        self.logs.append(log)
        self.procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                           start_new_session=True))
        f.close()  # the child holds its own copy

    # --- watching --------------------------------------------------------------------------------
    def records(self) -> list[dict]:
        return runs.live_records(self.run_dir)

    def last_step(self) -> int:
        recs = self.records()
        return int(recs[-1]["step"]) if recs else 0

    def wait_for_step(self, step: int, timeout: float = 300.0, poll: float = 0.02) -> int | None:
        """Block until rank 0 has logged ``step`` (returns the last logged step), or None if the
        run exited first."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            last = self.last_step()
            if last >= step:
                return last
            if all(p.poll() is not None for p in self.procs):
                return None
            time.sleep(poll)
        raise TimeoutError(f"{self.run_dir.name}: step {step} not reached in {timeout:.0f} s")

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def wait(self, timeout: float = 600.0, proc: int | None = None) -> int | None:
        """Exit code of the launcher (or of process ``proc``); None if it did not exit in time."""
        procs = self.procs if proc is None else [self.procs[proc]]
        end = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                return None
        return procs[0].returncode if len(procs) == 1 else max(abs(p.returncode) for p in procs)

    def stop(self) -> None:
        """Kill everything this run started: the launcher's session and every descendant (torchrun
        puts its workers in sessions of their own)."""
        for p in self.procs:
            for pid in [*_descendants(p.pid), p.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass

    def output(self) -> str:
        return "\n".join(log.read_text(errors="replace") for log in self.logs if log.is_file())

    # --- faults ----------------------------------------------------------------------------------
    def worker_pid(self, rank: int) -> int:
        if self.launcher == "manual":
            return self.procs[rank].pid
        root = self.procs[0].pid
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if (f"RANK={rank}".encode() in environ and re.search(rb"vlm\.(reliability\.)?train", cmdline)
                    and b"torch.distributed.run" not in cmdline and _descends_from(int(entry.name), root)):
                return int(entry.name)
        raise RuntimeError(f"{self.run_dir.name}: no worker with RANK={rank}")

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        os.kill(self.worker_pid(rank), sig)


def _descendants(root: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != root and _descends_from(int(entry.name), root):
            out.append(int(entry.name))
    return out


def _descends_from(pid: int, root: int) -> bool:
    """True if ``root`` is an ancestor of ``pid`` (the launcher may put its workers in new sessions)."""
    for _ in range(16):
        if pid == root:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # field 4: ppid (after the "(comm)" field)
        if pid <= 1:
            return False
    return False


def final_state(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "hf" / "model.safetensors"))


def max_param_diff(a: Path, b: Path) -> float:
    sa, sb = final_state(a), final_state(b)
    if sa.keys() != sb.keys():
        return float("inf")
    return max(float((sa[k].float() - sb[k].float()).abs().max()) if sa[k].numel() else 0.0 for k in sa)


def newest_step(ckpt_dir: Path) -> int:
    found = ckpt.find_checkpoint(ckpt_dir)
    return int(found.name.split("_")[1]) if found else 0


def latest_pointer(ckpt_dir: Path) -> str | None:
    path = Path(ckpt_dir) / ckpt.LATEST
    return path.read_text().strip() if path.is_file() else None
