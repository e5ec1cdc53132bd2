"""The per-device peak FLOP/s that MFU divides by: ``log.peak_flops``, a GPU's spec-sheet dense peak, or
on CPU a measured square-matmul rate (a CPU has no spec sheet to trust: its clock, vector units and the
threads it gets vary). The CPU rate is measured once per machine and cached (``peak_cache_path``: keyed by
CPU model, threads, torch version and dtype), so that two runs' MFU divide by the same peak;
``VLM_REMEASURE_PEAK=1`` measures again. ``resolve_peak`` says which one it used."""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from vlm.training.distributed import all_reduce_sum

MATMUL_N = 1024  # the square matmul timed on CPU (~2 GFLOP): large enough to reach the BLAS peak
MATMUL_REPEATS = 8  # timed runs after one warm-up; the fastest counts (a peak, not a mean)
_MEASURED: dict = {}  # (dtype, threads) -> FLOP/s, measured once per process
CACHE_DIR_ENV = "VLM_CACHE_DIR"  # the cache folder (default: $XDG_CACHE_HOME or ~/.cache, + conceptmoe-vl)
REMEASURE_ENV = "VLM_REMEASURE_PEAK"  # 1: measure the CPU peak again and replace the cached one
PEAK_FILE = "cpu_peak.json"

# dense bf16 peaks (spec sheets) by a substring of the device name
GPU_PEAKS = (("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("A100", 312e12), ("A800", 312e12),
             ("L40", 181e12), ("A10", 125e12), ("4090", 165e12), ("V100", 125e12))


def gpu_spec_peak() -> tuple[float, str]:
    """(dense bf16 peak, source) of the current CUDA device; 100 TFLOP/s for a name not in ``GPU_PEAKS``."""
    name = torch.cuda.get_device_name()
    for key, val in GPU_PEAKS:
        if key in name.upper():
            return val, f"{name} bf16 spec sheet"
    return 100e12, f"{name}: not in the spec-sheet table, a 100 TFLOP/s guess (set log.peak_flops)"


def measure_matmul_peak(dtype: torch.dtype = torch.float32, n: int = MATMUL_N,
                        repeats: int = MATMUL_REPEATS, fresh: bool = False) -> float:
    """FLOP/s of the fastest of ``repeats`` ``n x n`` matmuls on CPU at the current thread count (measured
    once per process unless ``fresh``)."""
    key = (dtype, torch.get_num_threads(), n)
    if fresh or key not in _MEASURED:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=g).to(dtype)
        b = torch.randn(n, n, generator=g).to(dtype)
        out = torch.empty(n, n, dtype=dtype)
        best = float("inf")
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            if i:  # the first run warms the allocator and BLAS
                best = min(best, time.perf_counter() - t0)
        _MEASURED[key] = 2.0 * n ** 3 / best
    return _MEASURED[key]


def peak_cache_path() -> Path:
    """``$VLM_CACHE_DIR/cpu_peak.json``, else ``$XDG_CACHE_HOME/conceptmoe-vl/...``, else ``~/.cache/...``."""
    root = os.environ.get(CACHE_DIR_ENV)
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "conceptmoe-vl")
    return Path(root) / PEAK_FILE


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def peak_key(dtype: torch.dtype) -> str:
    """What the cached peak depends on: CPU model, thread count, torch version, dtype (and the matmul)."""
    return (f"{cpu_model()} | {torch.get_num_threads()} threads | torch {torch.__version__} | "
            f"{str(dtype).removeprefix('torch.')} | {MATMUL_N}x{MATMUL_N} matmul")


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def cached_cpu_peak(dtype: torch.dtype) -> tuple[float, str, str]:
    """(FLOP/s, origin, where) of this machine's CPU matmul peak: the cached value for ``peak_key`` (origin
    ``cached (measured <date>)``), or one measured now and written to the cache (origin ``measured``; also
    with ``VLM_REMEASURE_PEAK=1``). ``where`` names the cache file."""
    path, key = peak_cache_path(), peak_key(dtype)
    remeasure = os.environ.get(REMEASURE_ENV) == "1"
    entry = None if remeasure else _read_cache(path).get(key)
    if isinstance(entry, dict) and isinstance(entry.get("flops"), (int, float)) and entry["flops"] > 0:
        return (float(entry["flops"]), f"cached (measured {entry.get('measured', '?')})",
                f"from {path}; {REMEASURE_ENV}=1 measures again")
    flops = measure_matmul_peak(dtype, fresh=remeasure)
    data = _read_cache(path)
    data[key] = {"flops": flops, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:  # atomic: the ranks of one machine may write at once
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
        where = f"cached in {path}"
    except OSError as err:
        where = f"not cached: {path}: {err.strerror or err}"
    return flops, "measured", where


def resolve_peak(configured: float | None, device: str, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s per device, where it comes from) for the MFU: ``log.peak_flops`` if set, else the GPU's
    spec sheet, else (CPU) this machine's cached matmul peak in the training dtype (``cached_cpu_peak``)."""
    if configured:
        return float(configured), "log.peak_flops"
    if device == "cuda" and torch.cuda.is_available():
        return gpu_spec_peak()
    # every rank measures at once on a cache miss (they share the machine's cores, as in training); the mean
    flops, origin, where = cached_cpu_peak(dtype)
    peak = float(all_reduce_sum(torch.tensor([flops], dtype=torch.float64))[0])
    peak /= torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return peak, (f"{origin}: fastest {MATMUL_N}x{MATMUL_N} {str(dtype).removeprefix('torch.')} matmul on "
                  f"{torch.get_num_threads()} CPU thread(s); {where}")
