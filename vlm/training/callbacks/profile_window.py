"""A ``torch.profiler`` window over a few training steps (``log.profile_steps: [first, last]``): how much of
the window the GPU spent running kernels (the rest is host overhead, launch latency or syncs), and the
kernels (on CPU, the ops) that took the most time. Written to ``<run>/profile.json`` and one log line."""
from __future__ import annotations

import json
import time

import torch

from vlm.training.callbacks.base import Callback, StepEnd

TOP = 15  # kernels (ops) listed in profile.json


def busy_time(intervals_us: list[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end]`` intervals (kernels on the device may overlap in streams)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals_us):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def summarize_profile(prof, window_s: float, steps: tuple[int, int], cuda: bool) -> dict:
    """The record of ``profile.json``: window, GPU busy / idle fraction (None on CPU), top kernels or ops."""
    from torch.autograd import DeviceType

    out: dict = {"steps": list(steps), "window_s": window_s, "device": "cuda" if cuda else "cpu",
                 "gpu_busy_fraction": None, "gpu_idle_fraction": None}
    if cuda:
        kernels = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
        busy = busy_time(kernels) / 1e6
        out["gpu_busy_fraction"] = min(busy / max(window_s, 1e-9), 1.0)
        out["gpu_idle_fraction"] = 1.0 - out["gpu_busy_fraction"]
        out["kernels"] = len(kernels)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    avgs = [a for a in prof.key_averages() if getattr(a, key) > 0]
    avgs.sort(key=lambda a: getattr(a, key), reverse=True)
    n_steps = steps[1] - steps[0] + 1
    out["top"] = [{"name": a.key, "calls_per_step": a.count / n_steps,
                   "ms_per_step": getattr(a, key) / 1e3 / n_steps} for a in avgs[:TOP]]
    return out


class ProfileWindow(Callback):
    """Profiles optimizer steps ``first..last`` (inclusive) of ``log.profile_steps`` on rank 0; no-op when
    unset. The window is timed between two device synchronizations, from before the first step reads its
    data to the end of the last step (first in the callback list: before that step's logging or saving).
    A run resumed inside the window profiles the rest of it; one resumed past it says so in one line."""

    def __init__(self):
        self.prof = None
        self.t0 = 0.0
        self.first = 0  # the first step profiled: the window's, or the step after a resume inside it

    def _range(self, trainer) -> tuple[int, int] | None:
        steps = trainer.cfg.log.profile_steps
        return (int(steps[0]), int(steps[1])) if steps and trainer.is_main else None

    def _sync(self, trainer) -> None:
        if trainer.device == "cuda":
            torch.cuda.synchronize()

    def _start(self, trainer) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device == "cuda" else [])
        self._sync(trainer)
        self.prof = profile(activities=acts)
        self.prof.start()
        self.t0 = time.perf_counter()

    def on_fit_start(self, trainer) -> None:
        r = self._range(trainer)
        if r is not None and trainer.step >= r[1]:
            trainer.log_line(f"[train] log.profile_steps [{r[0]}, {r[1]}]: this run starts after step "
                             f"{trainer.step}, past the window: nothing profiled")

    def on_step_start(self, trainer) -> None:
        r = self._range(trainer)
        if r is not None and self.prof is None and r[0] <= trainer.step + 1 <= r[1]:
            self.first = trainer.step + 1
            self._start(trainer)

    def on_step_end(self, trainer, step: StepEnd) -> None:
        if self.prof is None:
            return
        r = self._range(trainer)
        if step.step >= r[1] or step.last:
            self._sync(trainer)
            window_s = time.perf_counter() - self.t0
            self.prof.stop()
            rec = summarize_profile(self.prof, window_s, (self.first, step.step), trainer.device == "cuda")
            self.prof = None
            path = trainer.run_dir / "profile.json"
            path.write_text(json.dumps(rec, indent=1))
            idle = rec["gpu_idle_fraction"]
            where = f"GPU idle {idle:.1%} of the window" if idle is not None else "no GPU (ops timed on the host)"
            trainer.log_line(f"[train] profile of steps {self.first}-{step.step}: "
                             f"{window_s / (step.step - self.first + 1) * 1e3:.1f} "
                             f"ms/step, {where}; top: {rec['top'][0]['name'] if rec['top'] else '-'} -> {path}")

    def close(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
