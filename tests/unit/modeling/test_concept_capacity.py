"""The concept capacity (the model's runtime.capacity, chunking.form_concepts(capacity=)): the concept sequence is
T slots long, a host bound, instead of the longest row's concept count read from the device; the padded
slots change nothing: loss, outputs and gradients equal the path that reads M (packed rows with a host
layout, padded rows, looped / narrower concept layers, images; cached generation, whose prefill reads M,
against the full forward at capacity T)."""
from __future__ import annotations

import pytest
import torch
from conftest import build_model, left_padded, runtime
from test_host_layout import _packed

from vlm.modeling import syncs
from vlm.modeling.config_base import ConfigError
from vlm.modeling.chunking import CONCEPT_SYNC, ChunkModule
from vlm.modeling.varlen import DocLayout

CASES = {"last": {}, "sum-looped-dc96": {"concept_merge": "sum", "concept_loop_layers": [0],
                                         "concept_loop_times": 2, "concept_hidden_size": 96}}


def _step(model, batch, capacity: str, seed: int = 3):
    """Loss, logits and gradients of one training forward + backward under ``runtime.capacity = capacity``."""
    opts = runtime(model)
    old, opts.capacity = opts.capacity, capacity
    try:
        model.zero_grad()
        torch.manual_seed(seed)  # the boundary sampling draws the same numbers whatever M
        with syncs.counting() as named:
            out = model(**batch)
            (out.loss + out.logits.float().square().mean() if out.logits is not None else out.loss).backward()
    finally:
        opts.capacity = old
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads, named


def _same(a, b, what):
    (out_a, grads_a, _), (out_b, grads_b, _) = a, b
    torch.testing.assert_close(out_a.loss, out_b.loss, rtol=1e-6, atol=1e-7, msg=f"{what}: loss")
    if out_a.logits is not None:
        torch.testing.assert_close(out_a.logits, out_b.logits, rtol=1e-5, atol=1e-6, msg=f"{what}: logits")
    assert out_a.num_concepts is not None and torch.equal(out_a.num_concepts, out_b.num_concepts), \
        (what, out_a.num_concepts, out_b.num_concepts)
    assert grads_a.keys() == grads_b.keys()
    for k in grads_a:
        torch.testing.assert_close(grads_a[k], grads_b[k], rtol=1e-5, atol=1e-6, msg=f"{what}: grad {k}")


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_packed_batch_with_host_layout_reads_no_concept_count(overrides):
    """The training path (a packing collator's batch, host layout): capacity T, no read of M, the same
    loss and gradients as reading M."""
    model = build_model(**overrides).train()
    batch = _packed()
    layout = DocLayout.on_host(batch["attention_mask"].bool(), batch["segment_ids"])  # as the collator does
    ref = _step(model, {**batch, "doc_layout": layout}, "exact")
    got = _step(model, {**batch, "doc_layout": layout}, "tokens")  # what "auto" takes on a GPU once measured
    assert ref[2][CONCEPT_SYNC] == 1 and got[2][CONCEPT_SYNC] == 0, (ref[2], got[2])
    _same(ref, got, "packed")


def test_auto_capacity_is_t_on_a_gpu_with_a_host_layout_once_measured():
    """On the CPU reading M waits for nothing and M < T slots cost less: "auto" reads it there; on a GPU
    it takes T for host-laid-out batches only where the GPU verdicts mark capacity T correct and faster."""
    from vlm.modeling import verdicts
    from vlm.modeling.runtime import RuntimeOptions, use_tokens_capacity

    shown = verdicts.unmeasured()
    shown["paths"]["capacity_tokens"].update(correct=True, faster=True)
    auto = RuntimeOptions()
    assert use_tokens_capacity(auto, True, "cuda", shown)
    assert not use_tokens_capacity(auto, True, "cpu", shown)
    assert not use_tokens_capacity(auto, False, "cuda", shown)
    assert not use_tokens_capacity(auto, True, "cuda", verdicts.unmeasured())
    assert use_tokens_capacity(RuntimeOptions(capacity="tokens"), False, "cpu", verdicts.unmeasured())
    assert not use_tokens_capacity(RuntimeOptions(capacity="exact"), True, "cuda", shown)


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_padded_rows_with_capacity_equal_reading_the_count(overrides):
    model = build_model(**overrides).train()
    ids, am = left_padded(B=3, T=24, pad=7)
    am[2, :20] = 0  # a row with 4 real tokens
    batch = {"input_ids": ids, "attention_mask": am, "labels": ids.masked_fill(am == 0, -100)}
    ref, got = _step(model, batch, "exact"), _step(model, batch, "tokens")
    assert ref[2][CONCEPT_SYNC] == 1 and got[2][CONCEPT_SYNC] == 0
    _same(ref, got, "padded")


def test_vlm_with_images_capacity_equals_reading_the_count():
    from test_vlm_model import build, sample_batch
    model = build(modality_policy="split_at_switch").train()
    ids, mask, pixels = sample_batch(P=model.num_image_tokens)
    batch = {"input_ids": ids, "pixel_values": pixels, "attention_mask": mask,
             "labels": ids.masked_fill(mask == 0, -100)}
    ref, got = _step(model, batch, "exact"), _step(model, batch, "tokens")
    assert got[2][CONCEPT_SYNC] == 0
    _same(ref, got, "vlm")


def test_generation_reads_the_count_and_equals_the_forward_at_capacity_t():
    """Generation under ``runtime.capacity = "tokens"``: the prefill still reads the concept count (one
    ``CONCEPT_SYNC``: the concept caches are filled and sized by M, see ``_concept_capacity``), and its
    greedy tokens and scores (prefill, then cached steps) equal the full forward over the generated
    sequence at capacity T (no read of M): the count path against the capacity path."""
    from conftest import decisive, randomise_joint
    model = randomise_joint(decisive(build_model(concept_merge="sum"), 3))
    ids, am = left_padded(B=2, T=12, pad=4)
    n = 10
    runtime(model).capacity = "tokens"
    with torch.no_grad(), syncs.counting() as gen_syncs:
        gen = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=n, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
    full_am = torch.cat([am, torch.ones(2, n, dtype=am.dtype)], 1)
    with torch.no_grad(), syncs.counting() as full_syncs:
        full = model(gen.sequences, attention_mask=full_am)
    assert gen_syncs[CONCEPT_SYNC] == 1, f"the prefill read M {gen_syncs[CONCEPT_SYNC]} times, not once"
    assert full_syncs[CONCEPT_SYNC] == 0, f"the full forward read M {full_syncs[CONCEPT_SYNC]} times: not at capacity T"
    assert 0 < int(full.num_concepts.min()) < int(full_am.sum(1).min())  # real compression: M < T slots
    T = ids.shape[1]
    assert torch.equal(gen.sequences[:, T:], full.logits[:, T - 1:-1].argmax(-1))
    torch.testing.assert_close(torch.stack(gen.scores, 1), full.logits[:, T - 1:-1], rtol=1e-4, atol=1e-4)


def test_a_capacity_below_the_tokens_is_refused():
    class Cfg:
        concept_merge, boundary_mode = "last", "all"
    ch = ChunkModule(8, type("C", (), {"router_init": "identity"})())
    ch.cfg = Cfg()
    h, b = torch.randn(1, 6, 8), torch.ones(1, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match="could drop concepts"):
        ch.form_concepts(h, b, torch.ones(1, 6), b, None, capacity=5)
    con = ch.form_concepts(h, b, torch.ones(1, 6), b, None, capacity=6)
    assert con.x_BMD.shape == (1, 6, 8) and bool(con.valid_BM.all())


def test_an_unknown_capacity_mode_is_refused():
    want = "config error: runtime.capacity: input should be 'auto', 'tokens' or 'exact', got 'tight'"
    with pytest.raises(ConfigError) as err:
        build_model(**{"runtime.capacity": "tight"})
    assert str(err.value) == want
    with pytest.raises(ConfigError) as err:
        runtime(build_model()).capacity = "tight"
    assert str(err.value) == want


@pytest.mark.parametrize("tail", [64, 1])
@pytest.mark.parametrize("T", [7, 64, 150])
def test_concept_layout_from_the_host_token_layout_equals_building_it(T, tail):
    """varlen.concept_layout (token layout + device boundaries, no read): the attention of every real
    concept and its gradients equal those under DocLayout.build on the concept rows (rows of several
    documents, padded rows, an empty row, a row full of concepts)."""
    from vlm.modeling.varlen import TAIL, concept_layout, doc_attention
    g = torch.Generator().manual_seed(T)
    B = 4
    seg, valid = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.bool)
    for r, n in enumerate((T, T - T // 3, 0, T)):
        seg[r, :n] = 1 + (torch.arange(n) * 3 // max(n, 1))  # three documents
        valid[r, :n] = True
    b = (torch.rand(B, T, generator=g) < 0.5) & valid
    b[3] = True  # every token a concept: no padding slot in that row
    b |= valid & (seg != torch.nn.functional.pad(seg[:, :-1], (1, 0), value=-1))  # forced
    tokens = DocLayout.build(valid, seg)
    layout = concept_layout(tokens, b, tail)
    assert layout.cu_seq.numel() == tokens.num_docs + B * -(-T // tail) + 1 and tail in (TAIL, 1)
    cum = b.long().cumsum(1)
    valid_BM = torch.arange(T)[None] < cum[:, -1:]
    start = torch.searchsorted(cum, torch.arange(T)[None].expand(B, T).contiguous() + 1).clamp(max=T - 1)
    ref = DocLayout.build(valid_BM, torch.where(valid_BM, seg.gather(1, start), 0))
    q, k, v = (torch.randn(B, 4, T, 8, generator=g, requires_grad=True) for _ in range(3))
    keep = valid_BM[:, :, None, None]
    w = torch.randn(B, T, 4, 8, generator=g) * keep
    outs = [doc_attention(q, k, v, lay) for lay in (layout, ref)]
    torch.testing.assert_close(outs[0] * keep, outs[1] * keep)
    grads = [torch.autograd.grad((o * w).sum(), (q, k, v)) for o in outs]
    for a, c in zip(*grads):
        torch.testing.assert_close(a, c)
