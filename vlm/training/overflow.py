"""A non-finite gradient skips the step from ONE check, the global gradient norm.

ZeRO-1/2 computes the global gradient norm every step (for clipping and the logged grad norm; all-reduced,
so every rank agrees), and DeepSpeed 0.19 skips the step when that norm is inf / NaN with
``bf16.check_grad_overflow`` on (always in fp32). The norm is non-finite exactly when some gradient element
is, so the check DeepSpeed runs before it, ``has_inf_or_nan`` on every gradient partition (a few ops per
parameter: ~1,400 ops per step at the 1B preset's depth) plus an all-reduce and a host read, adds nothing:
``use_norm_overflow_check`` turns it off on the engine's optimizer. ZeRO-3 (it checks overflow in fp16
only) and optimizer offload (it tracks overflow while copying) are left as DeepSpeed has them.
"""
from __future__ import annotations


def use_norm_overflow_check(optimizer) -> bool:
    """Drop the per-partition overflow check of a ZeRO-1/2 optimizer whose global-norm check covers it;
    True when it did."""
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except ImportError:
        return False
    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return False
    if not (optimizer.compute_grad_norm and optimizer.check_grad_overflow) or optimizer.cpu_offload:
        return False

    def check_overflow(partition_gradients=True):  # the norm check in step() decides (module docstring)
        optimizer.overflow = False

    optimizer.check_overflow = check_overflow
    return True
