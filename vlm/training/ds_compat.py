"""The DeepSpeed the ZeRO-1/2 patches (overflow.py, zero_norm.py, one_rank.py) were tested on, and the check at
engine build that the installed one still is it: every method a patch replaces or calls (with its parameters),
every attribute it reads, and, by running ZeRO-1/2's own ``step()`` on a stub up to its skip decision, that a
non-finite global norm still skips the step. A patch whose check fails is not installed (DeepSpeed's own path
runs) and ``fallback_line`` says in one line what differed.
"""
from __future__ import annotations

import importlib
import inspect
import math
import re

import torch

from vlm.training.clip_scale import combined_scale

TESTED = ">=0.19.8,<0.20"  # pyproject.toml's deepspeed range (tests/unit/training/test_ds_compat.py)
TESTED_FROM, TESTED_BELOW = (0, 19, 8), (0, 20)
PATCHES = {"overflow": "the overflow check (overflow.py)", "norm": "the gradient norm (zero_norm.py)",
           "one_rank": "the one-rank reduction (one_rank.py)"}
_CACHE = "_vlm_ds_differences"

# what each patch replaces or calls on the optimizer's class: method -> its parameters after self
METHODS = {
    "overflow": {"check_overflow": ("partition_gradients",), "step": ("closure",)},
    "norm": {"get_grad_norm_direct": ("gradients", "params", "norm_type"), "scaled_global_norm": ("norm_type",),
             "unscale_and_clip_grads": ("grad_groups_flat", "total_norm"),
             "_model_parallel_all_reduce": ("tensor", "op"), "step": ("closure",)},
    "one_rank": {"allreduce_and_copy": ("small_bucket", "communication_data_type", "rank", "log", "divide",
                                        "process_group", "output_bucket")},
}
# the optimizer's attributes each patch reads
ATTRIBUTES = {
    "overflow": ("compute_grad_norm", "check_grad_overflow", "cpu_offload", "dtype"),
    "norm": ("cpu_offload", "loss_scale", "clip_grad", "model_parallel_rank", "device", "dp_process_group",
             "compute_grad_norm", "check_grad_overflow"),
    "one_rank": ("sequence_parallel_size", "dp_process_group"),
}
# the DeepSpeed module-level names each patch calls
MODULE_NAMES = {
    "norm": (("deepspeed.comm", "all_reduce"), ("deepspeed.comm", "ReduceOp"),
             ("deepspeed.runtime.constants", "PIPE_REPLICATED"),
             ("deepspeed.runtime.utils", "is_model_parallel_parameter"),
             ("deepspeed.runtime.utils", "mask_nan_or_inf_with_val_inplace"),
             ("deepspeed.runtime.zero.utils", "get_norm_dtype")),
    "one_rank": (("deepspeed.comm", "get_world_size"),),
}


def version_difference(version: str) -> str | None:
    """None when ``version`` (e.g. "0.19.8+abc") is inside TESTED."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    parts = tuple(int(x or 0) for x in m.groups()) if m else None
    if parts is None or not (TESTED_FROM <= parts and parts[:2] < TESTED_BELOW):
        return f"DeepSpeed {version} is outside the tested range {TESTED}"
    return None


def _method_difference(cls, name: str, params: tuple[str, ...]) -> str | None:
    fn = inspect.getattr_static(cls, name, None)
    if fn is None:
        return f"{cls.__name__}.{name} is missing"
    fn = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
    try:
        got = tuple(p for p in inspect.signature(fn).parameters if p != "self")
    except (TypeError, ValueError):
        return f"{cls.__name__}.{name} has no signature"
    return None if got == params else f"{cls.__name__}.{name}{got} is not {name}{params}"


class _Decided(Exception):
    pass


class _StepProbe:
    """What ZeRO-1/2's ``step()`` reads up to its skip decision, with the optimizer's own settings; the
    per-partition check is off (as overflow.py makes it) and the global norm is ``norm``. ``_update_scale``
    (called with the decision) records it and stops the step."""

    def __init__(self, optimizer, norm, dtype, check_grad_overflow):
        self.cpu_offload, self.compute_grad_norm = False, getattr(optimizer, "compute_grad_norm", True)
        self.check_grad_overflow, self.dtype = check_grad_overflow, dtype
        self.partition_gradients = getattr(optimizer, "partition_gradients", True)
        self.norm, self.overflow, self.skipped, self.loss_scale = norm, False, None, 1.0

    def _wait_for_offload_copies(self):
        pass

    def check_overflow(self, partition_gradients=True):
        self.overflow = False

    def scaled_global_norm(self, norm_type=2):
        return self.norm

    def _update_scale(self, has_overflow=False):
        self.skipped = bool(has_overflow)
        raise _Decided


def _skips(step, optimizer, norm, dtype, check_grad_overflow) -> bool | str:
    probe = _StepProbe(optimizer, norm, dtype, check_grad_overflow)
    try:
        step(probe)
    except _Decided:
        return probe.skipped
    except Exception as err:  # noqa: BLE001 -- a step() that reads what the probe lacks: not the tested one
        return f"{type(err).__name__}: {str(err)[:80]}"
    return "returned before deciding"


def step_skip_difference(cls, optimizer, dtype, check_grad_overflow, as_float: bool) -> str | None:
    """None when ``cls.step`` skips on every non-finite (or -1-masked) global norm and on no finite one; the norm
    as a float (zero_norm.py's) when ``as_float``, else as DeepSpeed's tensor and as a float."""
    bad = [math.nan, math.inf, -1.0] + ([] if as_float else [torch.tensor(v) for v in (math.nan, math.inf, -1.0)])
    good = [1.0] + ([] if as_float else [torch.tensor(1.0)])
    for norm, want in [(n, True) for n in bad] + [(n, False) for n in good]:
        got = _skips(cls.step, optimizer, norm, dtype, check_grad_overflow)
        if got is not want:
            what = "skips" if want else "runs"
            return f"{cls.__name__}.step() no longer {what} on a global norm of {float(norm)} ({got})"
    return None


def clip_difference(cls) -> str | None:
    """None when DeepSpeed's ``unscale_and_clip_grads`` divides by zero_norm.py's ``combined_scale``."""

    class Opt:
        device = "cpu"
    for norm, loss_scale, clip in ((3.0, 1.0, 1.0), (0.5, 1.0, 1.0), (6.0, 2.0, 1.0), (3.0, 1.0, 0.0),
                                   (math.inf, 1.0, 1.0), (-1.0, 1.0, 1.0)):
        opt = Opt()
        opt.clip_grad, opt.loss_scale = clip, loss_scale
        g_ds = torch.ones(2)
        try:
            cls.unscale_and_clip_grads(opt, [g_ds], torch.tensor(norm))
        except Exception as err:  # noqa: BLE001 -- any failure on the stub: not the tested method
            return f"{cls.__name__}.unscale_and_clip_grads on a stub: {type(err).__name__}"
        ours = torch.ones(2).mul_(1.0 / combined_scale(norm, loss_scale, clip))
        if not torch.allclose(g_ds, ours, rtol=1e-6, atol=0):
            return f"{cls.__name__}.unscale_and_clip_grads clips by another factor (norm {norm}, clip {clip})"
    return None


def differences(optimizer) -> dict[str, str]:
    """{patch: what differs} for a ZeRO-1/2 optimizer (empty for another optimizer, or when all is as tested)."""
    try:
        from deepspeed import __version__
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except ImportError as err:
        return {p: f"DeepSpeed's ZeRO-1/2 optimizer is not importable ({err})" for p in PATCHES}
    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return {}
    cls = type(optimizer)
    out: dict[str, str] = {}
    outside = version_difference(__version__)
    for patch in PATCHES:
        found = [outside] if outside else []
        found += [_method_difference(cls, n, ps) for n, ps in METHODS[patch].items()]
        found += [f"{cls.__name__}.{a} is missing" for a in ATTRIBUTES[patch] if not hasattr(optimizer, a)]
        for module, name in MODULE_NAMES.get(patch, ()):
            try:
                getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):
                found.append(f"{module}.{name} is missing")
        found = [f for f in found if f]
        if not found and patch == "overflow" and optimizer.compute_grad_norm and optimizer.check_grad_overflow:
            found = [step_skip_difference(cls, optimizer, optimizer.dtype, True, as_float=False)]
        if not found and patch == "norm" and optimizer.compute_grad_norm:
            found = [step_skip_difference(cls, optimizer, torch.float32, True, as_float=True), clip_difference(cls)]
        found = [f for f in found if f]
        if found:
            out[patch] = found[0]
    return out


def patchable(optimizer, patch: str) -> bool:
    """Whether ``patch`` may be installed on ``optimizer``: its check passed (computed once per optimizer)."""
    if not hasattr(optimizer, _CACHE):
        setattr(optimizer, _CACHE, differences(optimizer))
    return patch not in getattr(optimizer, _CACHE)


def fallback_line(optimizer) -> str | None:
    """One line naming each patch left out and the first thing that differed for it; None when none was."""
    found = getattr(optimizer, _CACHE, None) or {}
    if not found:
        return None
    from deepspeed import __version__

    by_reason: dict[str, list[str]] = {}
    for patch, why in found.items():
        by_reason.setdefault(why, []).append(PATCHES[patch])
    what = "; ".join(f"{', '.join(names)}: {why}" for why, names in by_reason.items())
    return (f"[train] DeepSpeed {__version__} differs from the one the ZeRO-1/2 patches were tested on ({TESTED}); "
            f"DeepSpeed's own path for {what}")
