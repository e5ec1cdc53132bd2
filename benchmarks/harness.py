"""Side-by-side timing: every variant of a question runs in the same process, interleaved round by round
(order flipped every round), warm-up excluded; medians, quartiles and per-round speed ratios.

The machines are shared and noisy, so quote ratios from these results, not latencies (benchmarks/README.md).
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Wall-clock seconds of one call, the device drained before and after."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def stats(xs: list) -> dict:
    """Median and quartiles (inclusive method; n = 1 and 2 handled)."""
    xs = sorted(float(x) for x in xs)
    if not xs:
        return {"n": 0, "median": float("nan"), "q1": float("nan"), "q3": float("nan"), "iqr": float("nan"),
                "min": float("nan"), "max": float("nan")}
    if len(xs) == 1:
        q1 = q3 = xs[0]
    else:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    med = statistics.median(xs)
    return {"n": len(xs), "median": med, "q1": q1, "q3": q3, "iqr": q3 - q1, "min": xs[0], "max": xs[-1],
            "iqr_rel": (q3 - q1) / med if med else float("nan")}


@dataclass
class Comparison:
    """Times (seconds) per variant, one entry per timed round, in round order."""
    times: dict
    rounds: int
    warmup: int
    order: list = field(default_factory=list)  # the variant order of each timed round

    def stats(self, name: str, scale: float = 1.0) -> dict:
        return stats([t * scale for t in self.times[name]])

    def median(self, name: str) -> float:
        return statistics.median(self.times[name])

    def speedup(self, base: str, new: str) -> dict:
        """How much faster ``new`` is than ``base`` (t_base / t_new - 1), two estimators + per-round IQR.

        The median of per-round ratios is the robust one: a round's variants ran back to back, so a
        slow phase of the machine hits both."""
        tb, tn = self.times[base], self.times[new]
        per_round = [b / n for b, n in zip(tb, tn)]
        s = stats(per_round)
        return {"ratio_of_medians": statistics.median(tb) / statistics.median(tn) - 1,
                "median_of_ratios": s["median"] - 1, "ratio_q1": s["q1"] - 1, "ratio_q3": s["q3"] - 1,
                "per_round": [r - 1 for r in per_round]}


def interleaved(variants: dict, device: torch.device, reps: int, warmup: int = 1, inner: int = 1,
                between: Callable[[], None] | None = None, log: Callable[[str], None] | None = None) -> Comparison:
    """Run every variant once per round, ``warmup`` + ``reps`` rounds, the order reversed every round.

    ``variants``: name -> zero-argument callable. ``inner``: calls per measurement (the time is
    divided by it; use it for sub-millisecond work). ``between``: called (untimed) before each
    measurement, e.g. to reset a decode cache. Warm-up rounds are run in the same interleaved way
    and discarded.
    """
    names = list(variants)
    times = {n: [] for n in names}
    order_log = []
    for r in range(warmup + reps):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            if between is not None:
                between(n)
            fn = variants[n]

            def run(fn=fn):
                for _ in range(inner):
                    fn()
            t = time_once(run, device) / inner
            if r >= warmup:
                times[n].append(t)
        if r >= warmup:
            order_log.append(list(order))
        if log is not None:
            tag = "warm-up" if r < warmup else f"round {r - warmup + 1}/{reps}"
            log(f"  {tag}: " + ", ".join(f"{n} {times[n][-1] * 1e3:.2f} ms" if r >= warmup else n for n in order))
    return Comparison(times, reps, warmup, order_log)


def matmul_peak_size(device: torch.device, dtype: torch.dtype, smoke: bool = False) -> int:
    if smoke:
        return 256
    return 8192 if device.type == "cuda" else 2048


def make_matmul(device: torch.device, dtype: torch.dtype, n: int) -> tuple[Callable[[], object], float]:
    """A square ``n x n`` matmul (the machine's practical peak for this dtype, timed as one more variant)
    and its FLOPs."""
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device, dtype)
    b = torch.randn(n, n, generator=g).to(device, dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)

    def fn():
        torch.mm(a, b, out=out)
    return fn, 2.0 * n ** 3


def _proc_status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                key, val = line.split(":")
                out[key] = int(val.split()[0]) * 1024
    return out


def _reset_rss_peak() -> bool:
    """Trim the freed malloc heap back to the OS and reset the kernel's RSS high-water mark (VmHWM) to
    the current RSS (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``). False where that is not possible."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory(fn: Callable[[], object], device: torch.device) -> dict:
    """Peak memory one call of ``fn`` adds on top of what was allocated before it (bytes).

    CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``. CPU: the process RSS
    high-water mark (``VmHWM``, reset to the current RSS first, the freed malloc heap trimmed) minus the
    RSS before the call; where the mark cannot be reset (not Linux), ``resource.getrusage`` ru_maxrss
    growth (a lower bound: 0 when an earlier call went higher). Returns {"bytes", "method"}."""
    gc.collect()
    if device.type == "cuda":
        sync(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        sync(device)
        return {"bytes": torch.cuda.max_memory_allocated(device) - before, "method": "cuda_max_memory_allocated"}
    try:
        if _reset_rss_peak():
            before = _proc_status()["VmRSS"]
            fn()
            return {"bytes": max(0, _proc_status()["VmHWM"] - before), "method": "rss_hwm_reset"}
    except OSError:
        pass
    import resource
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    fn()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"bytes": max(0, after - before), "method": "ru_maxrss_growth_lower_bound"}


def peak_memory_interleaved(fns: dict[str, Callable[[], object]], device: torch.device, n: int = 1) -> dict:
    """``peak_memory`` of every variant ``n`` times, the variants taking turns (round r: each once,
    the order rotated by r), so no variant always meets the heap as the previous one left it.
    Per variant: the median bytes and every sample."""
    keys = list(fns)
    samples: dict[str, list] = {k: [] for k in keys}
    for r in range(max(1, n)):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            samples[k].append(peak_memory(fns[k], device))
    out = {}
    for k, got in samples.items():
        xs = sorted(s["bytes"] for s in got)
        out[k] = {"bytes": statistics.median(xs), "samples": xs, "method": got[0]["method"]}
    return out
