"""Kernel-launching ATen ops of a piece of code, counted below autograd with a ``TorchDispatchMode``.

Every op that reaches the dispatcher counts, forward and backward (the autograd engine carries the
mode into the backward), except those that launch no kernel: views (``OpOverload.is_view``) and the
allocation / aliasing ops in ``NO_KERNEL``. A Triton kernel is not an ATen op and is not seen here.
On a GPU each counted op is one launch the host must issue, so the count bounds the host time of a
step whatever the width::

    with KernelOps() as ops:
        loss.backward()
    ops.total, ops.counts.most_common(5)
"""
from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
             "lift_fresh", "_unsafe_view", "_reshape_alias", "set_", "resize_", "_has_compatible_shallow_copy_type"}


class KernelOps(TorchDispatchMode):
    """Counts the kernel-launching ATen ops run inside the block (``counts``: op name -> calls)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NO_KERNEL:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())
