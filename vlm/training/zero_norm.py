"""The ZeRO-1/2 step's gradient norm: one foreach norm per group, ONE host read, clipping from the host value.

DeepSpeed 0.19's ZeRO-1/2 ``step()`` takes a norm per parameter (``vector_norm`` and a cast each: ~220
kernel launches per step at the 1B preset's depth), then reads the global norm on the host once to decide
whether to skip the step and once more per parameter group to clip (``is_invalid_grad_norm``: ``bool()``
on a device tensor, unnamed), and clips with a few device ops per group. ``use_one_norm_read`` keeps
what the step computes and decides, and changes how:

- each group's norm is one ``torch._foreach_norm`` (one multi-tensor kernel on CUDA), the same parameters
  counted (pipeline-replicated ones skipped, model-parallel ones on every rank), all-reduced as before;
- the global norm comes to the host ONCE, as a named read (``NORM_READ``), right where DeepSpeed's step
  decides whether a non-finite norm skips it (that decision also holds the LR schedule and counts the
  skipped step, so the host needs it); the logged grad norm is that same float;
- the clip factor is computed on the host from it, and each flat gradient partition is scaled by one
  ``mul_`` (none when the factor is 1).
Anything else (``norm_type`` other than 2, CPU offload's norm path, a DeepSpeed other than the tested one:
ds_compat.py) is DeepSpeed's own code.
"""
from __future__ import annotations

import torch

from vlm.modeling.syncs import host_sync
from vlm.training.clip_scale import combined_scale
from vlm.training.ds_compat import patchable

NORM_READ = ("optimizer step: the global gradient norm, read once (a non-finite norm skips the step and holds the "
             "LR schedule; the clip factor and the logged grad norm come from it)")


def use_one_norm_read(optimizer) -> bool:
    """Install the three replacements on a ZeRO-1/2 optimizer (not CPU offload); True when it did."""
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except ImportError:
        return False
    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or not patchable(optimizer, "norm") or optimizer.cpu_offload:
        return False
    direct, scaled, clip = optimizer.get_grad_norm_direct, optimizer.scaled_global_norm, optimizer.unscale_and_clip_grads

    def get_grad_norm_direct(gradients, params, norm_type=2):
        if float(norm_type) != 2.0:
            return direct(gradients, params, norm_type)
        return group_norm(optimizer, gradients, params)

    def scaled_global_norm(norm_type=2):
        norm = scaled(norm_type)
        with host_sync(NORM_READ):
            return float(norm)

    def unscale_and_clip_grads(grad_groups_flat, total_norm):
        if not isinstance(total_norm, float):
            return clip(grad_groups_flat, total_norm)
        scale_down(grad_groups_flat, combined_scale(total_norm, float(optimizer.loss_scale), optimizer.clip_grad))

    optimizer.get_grad_norm_direct = get_grad_norm_direct
    optimizer.scaled_global_norm = scaled_global_norm
    optimizer.unscale_and_clip_grads = unscale_and_clip_grads
    return True


def group_norm(optimizer, gradients, params) -> torch.Tensor:
    """The L2 norm of one group's gradients as DeepSpeed's ``get_grad_norm_direct`` takes it (same parameters,
    all-reduced over the data-parallel then the model-parallel group, inf / NaN masked to -1), from one
    ``_foreach_norm`` instead of a norm per parameter."""
    from deepspeed import comm as dist
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.utils import get_norm_dtype

    kept = []
    for g, p in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params):
        if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:
            continue
        if is_model_parallel_parameter(p) or optimizer.model_parallel_rank == 0:
            kept.append(g.detach())
    if kept:
        norms = torch._foreach_norm(kept, 2, dtype=get_norm_dtype())
        total = torch.stack(norms).square().sum().float()
    else:
        total = torch.tensor(0.0, dtype=torch.float32, device=optimizer.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=optimizer.dp_process_group)
    optimizer._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
    total = total.sqrt()
    mask_nan_or_inf_with_val_inplace(total, device=optimizer.device)
    return total


def scale_down(grad_groups_flat, combined: float) -> None:
    """Divide every flat gradient partition by ``combined`` (one ``mul_`` each; nothing when it is 1)."""
    if combined == 1.0:
        return
    for grad in grad_groups_flat:
        for g in (grad if isinstance(grad, list) else [grad]):
            g.data.mul_(1.0 / combined)
