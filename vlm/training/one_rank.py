"""One data-parallel rank: ZeRO-1/2 skips its gradient "reduction", which is the identity there.

On one rank DeepSpeed still flattens each gradient bucket, divides it by the world size (1), all-reduces it
over a group of one and copies every gradient back (``allreduce_and_copy``: a copy per parameter per step,
~110 launches at the 1B preset's depth). Each of these leaves the gradients bit for bit as they were, so
``skip_single_rank_reduction`` makes the call return at once when the group holds one rank (sequence
parallelism off); with more ranks, or a DeepSpeed other than the tested one (ds_compat.py), it is DeepSpeed's own.
"""
from __future__ import annotations

from vlm.training.ds_compat import patchable


def skip_single_rank_reduction(optimizer) -> bool:
    """Install the skip on a ZeRO-1/2 optimizer whose data-parallel group is one rank; True when it did."""
    try:
        from deepspeed import comm as dist
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except ImportError:
        return False
    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or not patchable(optimizer, "one_rank"):
        return False
    if optimizer.sequence_parallel_size != 1:
        return False
    if dist.get_world_size(group=optimizer.dp_process_group) != 1:
        return False
    original = optimizer.allreduce_and_copy

    def allreduce_and_copy(small_bucket, communication_data_type, rank=None, log=None, divide=True,
                           process_group=None, output_bucket=None):
        group = optimizer.dp_process_group if process_group is None else process_group
        if dist.get_world_size(group=group) == 1 and all(out is None for out in output_bucket or ()):
            return None
        return original(small_bucket, communication_data_type, rank=rank, log=log, divide=divide,
                        process_group=process_group, output_bucket=output_bucket)

    optimizer.allreduce_and_copy = allreduce_and_copy
    return True
