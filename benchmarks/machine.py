"""The machine a benchmark runs on: what it is (recorded with every result) and how many threads to use."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks import ROOT

_THREAD_CHOICE: dict = {}


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def load_average() -> list | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def resolve_threads(spec, device: torch.device) -> int:
    """``--threads``: an int, or "auto" (cached per process, so every benchmark of a run agrees)."""
    if spec not in (None, "auto", "0", 0):
        return int(spec)
    cores = available_cores()
    if device.type == "cuda" or cores == 1:
        return cores
    if "auto" not in _THREAD_CHOICE:
        _THREAD_CHOICE["auto"] = choose_threads(cores)
    return _THREAD_CHOICE["auto"]["threads"]


def choose_threads(cores: int, rounds: int = 3) -> dict:
    """1 thread or all cores, whichever is faster on a small mixed workload (~1-2 s).

    On an oversubscribed machine (other jobs keep the load average above the core count) OpenMP's
    spinning barriers make multi-threaded small ops 10-100x slower than one thread, which would
    turn every small-op-heavy figure (decode, MoE dispatch) into noise; on an idle machine all
    cores win. The choice and its timings are recorded in the results (``machine.thread_choice``).
    """
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, 512, generator=g), torch.randn(512, 512, generator=g)
    xs = [torch.randn(64, 128, generator=g) for _ in range(8)]
    w = torch.randn(128, 128, generator=g)

    def work():
        torch.mm(a, b)
        for x in xs:  # small ops, as in MoE dispatch and decoding
            torch.nn.functional.silu(x @ w).sum()
    res = {1: [], cores: []}
    old = torch.get_num_threads()
    for r in range(rounds + 1):
        for n in ((1, cores) if r % 2 == 0 else (cores, 1)):
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            for _ in range(3):
                work()
            if r:
                res[n].append(time.perf_counter() - t0)
    torch.set_num_threads(old)
    med = {n: statistics.median(v) for n, v in res.items()}
    best = min(med, key=med.get)
    return {"threads": best, "calibration_s": {str(n): v for n, v in med.items()},
            "load_average": load_average()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> list:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "sse4")))
    except OSError:
        pass
    return []


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=5)
        # the results folder is this run's output, not a change to the code that was measured
        dirty = subprocess.run(["git", "status", "--porcelain", "--", ".", ":(exclude)benchmarks/results"], cwd=ROOT,
                               capture_output=True, text=True, timeout=5)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info(device: torch.device | None = None) -> dict:
    import transformers
    info = {"timestamp": _dt.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
            "platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu": _cpu_model(), "cpu_flags": _cpu_flags(),
            "logical_cpus": os.cpu_count(), "usable_cores": available_cores(),
            "torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
            "mkl": torch.backends.mkl.is_available(), "mkldnn": torch.backends.mkldnn.is_available(),
            "load_average_1_5_15": load_average(), "git": _git_commit(),
            "thread_choice": _THREAD_CHOICE.get("auto", "fixed by --threads")}
    try:
        info["mem_total_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    if device is not None and device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, gpu_mem_gb=round(p.total_memory / 2**30, 1), gpu_sm=p.multi_processor_count,
                    gpu_capability=f"{p.major}.{p.minor}", cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version(), tf32=torch.backends.cuda.matmul.allow_tf32)
    return info
