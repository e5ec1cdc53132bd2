"""A non-finite gradient skips the step from ONE check: the global gradient norm where it is there, else
DeepSpeed's per-partition check.

ZeRO-1/2 computes the global gradient norm every step (for clipping and the logged grad norm; all-reduced,
so every rank agrees), and DeepSpeed 0.19 skips the step when that norm is inf / NaN with
``bf16.check_grad_overflow`` on (always in fp32). The norm is non-finite exactly when some gradient element
is, so the check DeepSpeed runs before it, ``has_inf_or_nan`` on every gradient partition (a few ops per
parameter: ~1,400 ops per step at the 1B preset's depth) plus an all-reduce and a host read, adds nothing:
``use_norm_overflow_check`` turns it off on the engine's optimizer. ZeRO-3 (it checks overflow in fp16
only) and optimizer offload (it tracks overflow while copying) are left as DeepSpeed has them.

Where the step would not skip on a non-finite norm (``zero_optimization.compute_grad_norm`` off, or a
DeepSpeed without that skip: ds_compat.py) the per-partition check is the only one: it stays in bf16, and in
fp32, where DeepSpeed leaves it off, ``use_norm_overflow_check`` turns it on.
"""
from __future__ import annotations

import torch

from vlm.training.ds_compat import patchable, step_skip_difference


def use_norm_overflow_check(optimizer) -> bool:
    """Drop the per-partition overflow check of a ZeRO-1/2 optimizer whose global-norm check covers it;
    True when it did. In fp32 without that norm check, turn the per-partition check on instead."""
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except ImportError:
        return False
    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or keep_partition_check(optimizer):
        return False
    if not patchable(optimizer, "overflow"):
        return False
    if not (optimizer.compute_grad_norm and optimizer.check_grad_overflow) or optimizer.cpu_offload:
        return False

    def check_overflow(partition_gradients=True):  # the norm check in step() decides (module docstring)
        optimizer.overflow = False

    optimizer.check_overflow = check_overflow
    return True


def keep_partition_check(optimizer) -> bool:
    """fp32 ZeRO-1/2 (not offload) whose step() does not skip on a non-finite global norm: DeepSpeed's
    per-partition check on (``check_grad_overflow``, off in fp32); True when it turned it on."""
    if getattr(optimizer, "dtype", None) == torch.bfloat16 or getattr(optimizer, "check_grad_overflow", True):
        return False
    if getattr(optimizer, "cpu_offload", True) or not hasattr(type(optimizer), "check_overflow"):
        return False
    if step_skip_difference(type(optimizer), optimizer, optimizer.dtype, False, as_float=False) is None:
        return False
    optimizer.check_grad_overflow = True
    return True
