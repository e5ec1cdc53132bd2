"""The factor ZeRO-1/2 divides the gradients by: the loss scale times the clip factor (DeepSpeed's formula).

Used by zero_norm.py (the clip from the host's norm) and ds_compat.py (DeepSpeed's own clip checked equal).
"""
from __future__ import annotations

import math


def combined_scale(total_norm: float, loss_scale: float, clip_grad: float) -> float:
    """DeepSpeed's factor that the gradients are divided by: the loss scale, times the clip factor
    ``max(1, (norm / loss_scale + 1e-6) / clip_grad)`` when clipping is on (an invalid norm clips by inf)."""
    if clip_grad <= 0.0:
        return loss_scale
    norm = total_norm if math.isfinite(total_norm) and total_norm >= 0 else math.inf
    return max(1.0, (norm / loss_scale + 1e-6) / clip_grad) * loss_scale
