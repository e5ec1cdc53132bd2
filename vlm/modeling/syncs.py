"""Named host syncs: every place the training forward / backward reads device data on the host.

A host read of a CUDA tensor (``.item()``, ``.tolist()``, ``int(t)``, ``bool(t)``, boolean-mask
indexing, ``nonzero`` ...) blocks the CPU until the GPU has caught up, so the CPU can no longer run
ahead queueing kernels. The model reads the device only where a shape must be known, and each such
read sits inside ``host_sync(reason)``::

    with host_sync("chunking: the concept count M is the concept sequence's length"):
        M = int(count_B.max())

``host_sync`` counts its entries per reason (``counts``; ``counting()`` gives a fresh counter for
a block of code) and, under ``torch.cuda.set_sync_debug_mode("error")``, lets the named read through
(the mode is 0 inside the block), so a CUDA test can fail on any other sync. ``active()`` tells a
detector (tests/unit/modeling/test_host_syncs.py) whether it is inside a named block.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch

counts: Counter = Counter()
_stack: list[str] = []


def active() -> str | None:
    """The reason of the innermost ``host_sync`` block, or None outside one."""
    return _stack[-1] if _stack else None


@contextmanager
def host_sync(reason: str):
    """Marks a deliberate host read of device data (see the module docstring)."""
    counts[reason] += 1
    _stack.append(reason)
    debug = torch.cuda.get_sync_debug_mode() if torch.cuda.is_initialized() else 0
    if debug:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        if debug:
            torch.cuda.set_sync_debug_mode(debug)
        _stack.pop()


@contextmanager
def counting():
    """A fresh ``Counter`` of the ``host_sync`` entries (reason -> count) made inside the block."""
    before = counts.copy()
    seen: Counter = Counter()
    try:
        yield seen
    finally:
        seen.update(counts - before)
