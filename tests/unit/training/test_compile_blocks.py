"""``train.compile`` (issue 34 item 4): every transformer block is one graph (``fullgraph=True``), and
packings of other lengths reuse it.

- one MoE block of the tiny ConceptMoE (attention over packed documents + routed experts, forward
  and the experts' backward) traces with 0 graph breaks (``torch._dynamo.explain``): a host read
  planted in the MoE fails here (scripts/planted_bugs.py "34-moe-item");
- a block compiled by ``compile_blocks`` (fullgraph, fp32; aot_eager here, inductor in the
  integration tier) gives the eager outputs and gradients;
- 20 training steps of the tiny ConceptMoE over packings of 20 lengths: every block graph is made
  in the first two steps, none after (the token dimension marked dynamic; the CPU attention
  under compile reads no host list of documents: ``varlen._masked``, checked against the loop kernel);
- the experts' grouped GEMM traces in fp32 (``conceptmoe::grouped_mm``: its fake shapes are the
  kernel's).
The whole forward's graph breaks: tests/integration/training/test_compile.py.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from vlm.modeling import varlen
from vlm.modeling.blocks import TransformerBlock
from vlm.modeling.grouped_mm import META_TRACEABLE, _OP, _out_shape
from vlm.training.compile import compile_blocks

from conftest import build_model


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def packed_batch(T: int, seed: int, B: int = 2, V: int = 2048) -> dict:
    """B rows of T tokens, each row 3 documents of random lengths (segment ids 1..3), row 1 ending
    in 3 padding tokens."""
    g = torch.Generator().manual_seed(seed)
    seg = torch.zeros(B, T, dtype=torch.long)
    pos = torch.zeros(B, T, dtype=torch.long)
    for r in range(B):
        a, b = sorted(torch.randperm(T - 4, generator=g)[:2].add(1).tolist())
        bounds = [0, a, b, T - 3 * r]
        for k in range(3):
            seg[r, bounds[k]:bounds[k + 1]] = k + 1
            pos[r, bounds[k]:bounds[k + 1]] = torch.arange(bounds[k + 1] - bounds[k])
    am = (seg > 0).long()
    ids = torch.randint(1, V, (B, T), generator=g) * am
    return {"input_ids": ids, "attention_mask": am, "position_ids": pos, "segment_ids": seg,
            "labels": ids.masked_fill(am == 0, -100)}


def block_inputs(model, batch):
    """The first MoE block of ``model`` and the arguments it gets in a training forward of ``batch``."""
    block = next(m for m in model.modules() if isinstance(m, TransformerBlock) and m.is_moe)
    seen = []
    handle = block.register_forward_pre_hook(lambda m, a, k: seen.append((a, k)) if not seen else None,
                                              with_kwargs=True)
    model(**batch)
    handle.remove()
    return block, seen[0]


def test_one_block_is_one_graph():
    """Attention over a packed DocLayout + the MoE (routing, grouped GEMMs, the autograd function's
    backward): one graph, no break."""
    model = build_model("tiny_concept").train()
    block, (args, kwargs) = block_inputs(model, packed_batch(24, seed=0))
    assert isinstance(kwargs["mask"], varlen.DocLayout)
    ex = torch._dynamo.explain(block)(*args, **kwargs)
    assert ex.graph_break_count == 0, [r.reason.splitlines()[0] for r in ex.break_reasons]
    assert ex.graph_count == 1


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.integration)])
def test_compiled_block_equals_eager(backend):
    """``compile_blocks`` on one block (fullgraph, fp32; aot_eager: the traced forward and backward
    graphs, inductor: also the generated code, ~1 min on a busy CPU, so integration): outputs, aux
    losses, input and parameter gradients equal the eager block's (<= 1e-5)."""
    model = build_model("tiny_concept").train()
    eager, (args, kwargs) = block_inputs(model, packed_batch(16, seed=1))
    compiled = copy.deepcopy(eager)
    assert compile_blocks(compiled, backend=backend) == 1
    results = []
    for block in (eager, compiled):
        x = args[0].detach().clone().requires_grad_()
        y, stats = block(x, *args[1:], **kwargs)
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
        ((y * w).sum() + stats.lb_loss + stats.z_loss).backward()
        results.append([y, stats.lb_loss, stats.z_loss, x.grad] + [p.grad for p in block.parameters()])
    for i, (want, got) in enumerate(zip(*results)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"tensor {i}")


def test_no_recompiles_over_20_packings():
    """Training forward + backward over 20 packings (T from 20 to 58, three documents a row at random
    cuts, padding): the blocks' graphs (token, concept, joint decoder) are all made in the first two
    steps. Dynamo only (a counting backend): what is compiled, not how."""
    model = build_model("tiny_concept").train()
    counter = CompileCounter()
    compile_blocks(model, backend=counter)
    frames = []
    for step in range(20):
        out = model(**packed_batch(20 + 2 * step, seed=step))
        out.loss.backward()
        frames.append(counter.frame_count)
    assert frames[1] > 0
    assert frames[-1] == frames[1], frames


@pytest.mark.parametrize("case", ["packed", "interleaved"])
def test_masked_kernel_equals_loop(case):
    """Under torch.compile the CPU document attention is ``_masked`` (one SDPA, a mask from the
    layout's tensors): every output (padding too: a query alone in its document returns its value)
    and q / k / v gradient equal the eager loop kernel's."""
    P = -1
    rows = {"packed": [[1, 1, 1, 2, 3, 3, 3, 3, 3, 4, 5, 5, 5, 5], [1] * 10 + [P] * 4],
            "interleaved": [[0, 0, 1, 1, 0, P, 0, 2, 2, 1, 0, 3, P, 0], [P] * 3 + [4] * 11]}[case]
    seg = torch.tensor(rows)
    valid = seg != P
    layout = varlen.DocLayout.build(valid, seg.clamp(min=0))
    g = torch.Generator().manual_seed(3)
    qkv = [torch.randn(2, h, 14, 8, generator=g) for h in (4, 2, 2)]
    w = torch.randn(2, 14, 4, 8, generator=g)
    results = []
    for fn in (varlen.doc_attention, torch.compile(varlen.doc_attention, backend="eager", fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in qkv]
        out = fn(*leaves, layout)
        (out * w).sum().backward()
        results.append([out] + [t.grad for t in leaves])
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(_OP is None, reason="no torch._grouped_mm")
def test_grouped_mm_op_fake_shapes_are_the_kernels():
    """The four layouts of the experts' grouped GEMMs (forward [S, D] x [E, D, N], the backward's
    transposed weights and the K-jagged weight gradients): the custom op's fake output shape, its
    kernel's output (contiguous) and torch's own equal; fp32 has no meta function of torch's here."""
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor([3, 7, 7, 12], dtype=torch.int32)  # every row in a group: no unwritten rows
    x_SD, w_EDN, g_SN = torch.randn(12, 8, generator=g), torch.randn(4, 8, 16, generator=g), torch.randn(12, 16, generator=g)
    for a, b in ((x_SD, w_EDN), (g_SN, w_EDN.transpose(-2, -1)), (x_SD.t(), g_SN)):
        got = _OP(a, b, offs)
        want = torch._grouped_mm(a, b, offs=offs)
        assert list(got.shape) == _out_shape(a, b, offs) == list(want.shape)
        assert got.is_contiguous()
        torch.testing.assert_close(got, want)
    assert META_TRACEABLE[torch.bfloat16]
