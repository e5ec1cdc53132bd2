"""``train.compile`` (issue 17, item 5): ``compile_blocks`` compiles every transformer block in place;
the tiny ConceptMoE compiled (inductor: g++ is present here) gives the eager forward
and gradients (fp32; measured here: loss identical, max grad diff ~1e-7, asserted <= 1e-5), and a
few training steps with ``train.compile: true`` log the losses of the eager run (trainer wiring).

Every block is one graph (``fullgraph=True``), fp32 experts included (``torch._grouped_mm``'s meta
function is bf16-only in this torch: ``grouped_mm_traceable``; under compile the experts call it
through ``conceptmoe::grouped_mm``). The whole forward's graph breaks are counted here (Dynamo
tracing of the whole tiny model: 25-60 s on 2 busy cores); one block's, and recompiles:
tests/unit/training/test_compile_blocks.py."""
from __future__ import annotations

import _train_helpers as helpers
import pytest
import torch

from vlm.modeling.blocks import TransformerBlock
from vlm.training import compile as compile_mod

from conftest import build_model, left_padded

TOL = 1e-5

@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()

def _loss_and_grads(model, ids, am, labels):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the training forward draws random numbers: the same ones for both
    out = model(ids, attention_mask=am, labels=labels)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

def test_compiled_conceptmoe_forward_backward_equals_eager():
    """Inductor (what ``train.compile`` runs): padded rows, labels, two steps (the second reuses the
    compiled graphs). Checkpointed compiled blocks: test_activation_checkpointing.py."""
    backend = "inductor"
    eager, compiled = build_model("tiny_concept").train(), build_model("tiny_concept").train()
    names = [n for n, _ in compiled.named_parameters()]
    assert compile_mod.compile_blocks(compiled, backend=backend) == 4
    assert [n for n, _ in compiled.named_parameters()] == names  # in place: same names, same state dict
    ids, am = left_padded(B=2, T=24, pad=5)
    labels = ids.masked_fill(am == 0, -100)
    for _ in range(2):
        want, want_g = _loss_and_grads(eager, ids, am, labels)
        got, got_g = _loss_and_grads(compiled, ids, am, labels)
        for key in ("loss", "lm_loss", "ratio_loss", "lb_loss", "z_loss"):
            assert float((getattr(got, key) - getattr(want, key)).detach().abs()) <= TOL, key
        assert torch.equal(got.boundary_mask, want.boundary_mask)
        assert want_g.keys() == got_g.keys()
        worst = max(float((got_g[n] - want_g[n]).abs().max()) for n in want_g)
        assert worst <= TOL, worst

# the host reads left between the blocks, each a ``torch.compiler.disable``d function: the token
# stack's document layout, chunking's concept count M, the concept stack's layout
HOST_READS = {"attention_mask", "form_concepts", "_chunked", "forward"}
MAX_BREAKS = 7  # measured (packed rows, fp32): 7 breaks, 8 graphs; on 3353fb1 (bf16, fp32 errored) 43


def test_whole_forward_graph_breaks():
    """``torch._dynamo.explain`` on the whole training forward of packed rows: every graph break is at
    a host read that shapes what follows (the document layouts, the concept count M; the break
    splits each enclosing frame), none inside a block."""
    seg = torch.tensor([[1] * 11 + [2] * 17 + [3] * 12, [1] * 9 + [2] * 21 + [0] * 10])  # 0: padding
    pos = torch.cat([torch.arange(n) for n in (11, 17, 12, 9, 21)] + [torch.zeros(10, dtype=torch.long)]).view(2, 40)
    am = (seg > 0).long()
    ids = torch.randint(1, 2048, (2, 40), generator=torch.Generator().manual_seed(4)) * am
    model = build_model("tiny_concept").train()
    ex = torch._dynamo.explain(model)(ids, attention_mask=am, position_ids=pos, segment_ids=seg,
                                      labels=ids.masked_fill(am == 0, -100))
    where = [(r.reason.splitlines()[0], r.user_stack[-1].name if r.user_stack else None) for r in ex.break_reasons]
    assert ex.graph_break_count <= MAX_BREAKS, where
    assert all("compiler.disable()" in reason and fn in HOST_READS for reason, fn in where), where


def test_grouped_mm_traceable_by_dtype():
    """fp32: torch's meta function refuses it (compiled blocks call ``conceptmoe::grouped_mm``); bf16 traced."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("no torch._grouped_mm")
    assert not compile_mod.grouped_mm_traceable(torch.float32)
    assert compile_mod.grouped_mm_traceable(torch.bfloat16)

def test_train_compile_steps_equal_eager(tmp_path, monkeypatch):
    """3 training steps of the tiny ConceptMoE LM (fp32, ZeRO-2, one process) with ``train.compile:
    true`` log the eager run's losses (<= 1e-5). The backend is aot_eager here to keep the test
    short (inductor's exactness is the test above); the trainer's own call is what runs."""
    calls = []

    def spy(model, dtype, **kw):
        calls.append(dtype)
        return compile_mod.compile_blocks(model, dtype, backend="aot_eager", **kw)
    monkeypatch.setattr("vlm.training.prepare.compile_blocks", spy)
    runs = {}
    for name, flag in (("eager", False), ("compiled", True)):
        raw = helpers.config(tmp_path, name=name, train={"max_steps": 3, "compile": flag},
                             checkpoint={"every_steps": 0, "save_final": False})
        trainer = helpers.run_inprocess(raw, tmp_path)
        runs[name] = helpers.records(tmp_path / name)
        blocks = [m for m in trainer.engine.module.modules() if isinstance(m, TransformerBlock)]
        assert all((m._compiled_call_impl is not None) == flag for m in blocks)
    assert calls == [torch.float32]
    for key in ("loss", "lm_loss", "ratio_loss", "lb_loss"):
        want, got = [r[key] for r in runs["eager"]], [r[key] for r in runs["compiled"]]
        assert len(want) == 3 and max(abs(a - b) for a, b in zip(want, got)) <= TOL, (key, want, got)
