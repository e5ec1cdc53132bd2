"""The per-device peak FLOP/s that MFU divides by: ``log.peak_flops``, a GPU's spec-sheet dense peak, or
on CPU a measured square-matmul rate (a CPU has no spec sheet to trust: its clock, vector units and the
threads it gets vary). ``resolve_peak`` says which one it used."""
from __future__ import annotations

import time

import torch

from vlm.training.distributed import all_reduce_sum

MATMUL_N = 1024  # the square matmul timed on CPU (~2 GFLOP): large enough to reach the BLAS peak
MATMUL_REPEATS = 4  # timed runs after one warm-up; the fastest counts (a peak, not a mean)
_MEASURED: dict = {}  # (dtype, threads) -> FLOP/s, measured once per process

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
                        repeats: int = MATMUL_REPEATS) -> float:
    """FLOP/s of the fastest of ``repeats`` ``n x n`` matmuls on CPU at the current thread count."""
    key = (dtype, torch.get_num_threads(), n)
    if key not in _MEASURED:
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


def resolve_peak(configured: float | None, device: str, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s per device, where it comes from) for the MFU: ``log.peak_flops`` if set, else the GPU's
    spec sheet, else (CPU) a measured matmul peak in the training dtype."""
    if configured:
        return float(configured), "log.peak_flops"
    if device == "cuda" and torch.cuda.is_available():
        return gpu_spec_peak()
    # every rank measures at once (they share the machine's cores, as in training); the mean over ranks
    peak = float(all_reduce_sum(torch.tensor([measure_matmul_peak(dtype)], dtype=torch.float64))[0])
    peak /= torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return peak, (f"measured: fastest {MATMUL_N}x{MATMUL_N} {str(dtype).removeprefix('torch.')} matmul on "
                  f"{torch.get_num_threads()} CPU thread(s)")
