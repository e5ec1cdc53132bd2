"""benchmarks/op_counter.py: what it counts as a kernel launch, a host read (named or unnamed) and where an
op comes from; and the overhead benchmark's packed batch."""
from __future__ import annotations

import pytest
import torch

from benchmarks.op_counter import OpCounter, launches_kernel
from benchmarks.overhead import DOCS, packed_batch
from vlm.modeling import syncs


def test_views_and_allocations_launch_nothing_arithmetic_does():
    x = torch.randn(4, 6)
    with OpCounter() as oc:
        y = x.view(6, 4).t().unsqueeze(0)  # three views
        torch.empty(3)
        z = y + 1  # one kernel
        z.mul_(2)  # one kernel (in place)
        z.sum()  # one kernel
    assert oc.ops_by("op") == {"add": 1, "mul_": 1, "sum": 1}, oc.ops_by("op")
    assert not launches_kernel(torch.ops.aten.view.default) and launches_kernel(torch.ops.aten.add.Tensor)


def test_host_reads_are_named_inside_host_sync_and_unnamed_outside():
    t = torch.tensor([1, 2, 3])
    with OpCounter() as oc:
        int(t.max())
        t.tolist()
        t[t > 1]
        with syncs.host_sync("a shape"):
            t.sum().item()
    assert [op for op, _ in oc.unnamed_syncs()] == ["_local_scalar_dense", "tolist", "index[bool mask]"]
    assert oc.named_syncs() == {"a shape": 1}


def test_ops_are_attributed_to_their_phase_and_source_file():
    from vlm.modeling.dechunk import ema_reference  # a vlm/modeling/dechunk.py function

    x = torch.randn(1, 5, 3, requires_grad=True)
    p = torch.rand(1, 5).clamp(0.1, 0.9)
    with OpCounter() as oc:
        with oc.phase("forward"):
            out = ema_reference(x, p)
        with oc.phase("backward"):
            out.sum().backward()
    by = oc.ops_by()
    assert by[("forward", "dechunk")] > 0 and by[("backward", "autograd")] > 0
    assert {p for p, _ in by} == {"forward", "backward"}


def test_packed_batch_holds_docs_documents_with_restarting_positions():
    b = packed_batch(512, 100)
    assert b["input_ids"].shape == (1, 512) and int(b["segment_ids"].max()) == DOCS
    starts = (b["position_ids"][0] == 0).nonzero().flatten().tolist()
    assert len(starts) == DOCS and starts[0] == 0
    assert (b["labels"][0, starts] == -100).all() and (b["labels"][0] != -100).sum() == 512 - DOCS
    # the collator's host-built token layout travels with it (the trainer hands it to the model)
    layout = b["doc_layout"]
    assert (layout.B, layout.T, layout.num_docs, layout.max_len) == (1, 512, DOCS, int(b["position_ids"].max()) + 1)
    assert "pieces" in layout.__dict__


def test_a_scalar_read_under_inference_mode_is_refused_not_missed():
    """Under torch.inference_mode, ``.item()`` / ``int(t)`` never reach a dispatch mode: a counter there
    would report 0 syncs for a step that syncs, so it refuses to count; under no_grad the read is seen."""
    t = torch.arange(4)
    with torch.no_grad(), OpCounter() as oc:
        int(t.max())
    assert [op for op, _ in oc.unnamed_syncs()] == ["_local_scalar_dense"]
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"), OpCounter():
        int(t.max())
