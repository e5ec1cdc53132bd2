"""The concept capacity (conceptmoe.CAPACITY, chunking.form_concepts(capacity=)): the concept sequence is
T slots long, a host bound, instead of the longest row's concept count read from the device; the padded
slots change nothing: loss, outputs and gradients equal the path that reads M (packed rows with a host
layout, padded rows, looped / narrower concept layers, images, cached generation)."""
from __future__ import annotations

import pytest
import torch

from vlm.modeling import conceptmoe, syncs
from vlm.modeling.chunking import CONCEPT_SYNC, ChunkModule
from vlm.modeling.varlen import DocLayout

from conftest import build_model, left_padded
from test_host_layout import _packed

CASES = {"last": {}, "sum-looped-dc96": {"concept_merge": "sum", "concept_loop_layers": [0],
                                         "concept_loop_times": 2, "concept_hidden_size": 96}}


def _step(model, batch, capacity: str, seed: int = 3):
    """Loss, logits and gradients of one training forward + backward under ``CAPACITY = capacity``."""
    old, conceptmoe.CAPACITY = conceptmoe.CAPACITY, capacity
    try:
        model.zero_grad()
        torch.manual_seed(seed)  # the boundary sampling draws the same numbers whatever M
        with syncs.counting() as named:
            out = model(**batch)
            (out.loss + out.logits.float().square().mean() if out.logits is not None else out.loss).backward()
    finally:
        conceptmoe.CAPACITY = old
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads, named


def _same(a, b, what):
    (out_a, grads_a, _), (out_b, grads_b, _) = a, b
    torch.testing.assert_close(out_a.loss, out_b.loss, rtol=1e-6, atol=1e-7, msg=f"{what}: loss")
    if out_a.logits is not None:
        torch.testing.assert_close(out_a.logits, out_b.logits, rtol=1e-5, atol=1e-6, msg=f"{what}: logits")
    assert torch.equal(out_a.num_concepts_B, out_b.num_concepts_B) if hasattr(out_a, "num_concepts_B") else True
    assert grads_a.keys() == grads_b.keys()
    for k in grads_a:
        torch.testing.assert_close(grads_a[k], grads_b[k], rtol=1e-5, atol=1e-6, msg=f"{what}: grad {k}")


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_packed_batch_with_host_layout_reads_no_concept_count(overrides):
    """The training path (a packing collator's batch, host layout): capacity T, no read of M, the same
    loss and gradients as reading M."""
    model = build_model(**overrides).train()
    batch = _packed()
    layout = DocLayout.build(batch["attention_mask"].bool(), batch["segment_ids"])
    layout.pieces
    ref = _step(model, {**batch, "doc_layout": layout}, "exact")
    got = _step(model, {**batch, "doc_layout": layout}, "auto")
    assert ref[2][CONCEPT_SYNC] == 1 and got[2][CONCEPT_SYNC] == 0, (ref[2], got[2])
    _same(ref, got, "packed")


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


def test_generation_with_capacity_equals_reading_the_count():
    """Greedy generation (prefill over the prompt at capacity T, then cached steps) gives the same tokens
    and scores as the prefill that reads M."""
    from conftest import decisive, randomise_joint
    model = randomise_joint(decisive(build_model(concept_merge="sum"), 3))
    ids, am = left_padded(B=2, T=12, pad=4)
    outs = []
    for capacity in ("exact", "tokens"):
        old, conceptmoe.CAPACITY = conceptmoe.CAPACITY, capacity
        try:
            with torch.no_grad():
                outs.append(model.generate(input_ids=ids, attention_mask=am, max_new_tokens=10, do_sample=False,
                                           output_scores=True, return_dict_in_generate=True))
        finally:
            conceptmoe.CAPACITY = old
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for a, b in zip(outs[0].scores, outs[1].scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


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


def test_an_unknown_capacity_mode_is_refused(monkeypatch):
    monkeypatch.setattr(conceptmoe, "CAPACITY", "tight")
    with pytest.raises(ValueError, match="CAPACITY='tight'"):
        conceptmoe.concept_capacity(8, True)
