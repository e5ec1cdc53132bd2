"""vlm/modeling/conceptmoe.py: causality, packing, joint decoding layout, looping / d_c, and the
plain-MoE identities (chunking off; conversion with every token a concept).

Tests marked ``device`` run on ``VLM_TEST_DEVICE`` (tests/_device.py): fp32 for the identities
(causality, packing, chunking off, conversion); the forward/backward finiteness test in bf16 on CUDA.
Models are built and modified (decisive router, joint projections) on the CPU, then moved, so a
CUDA run checks the same weights. Construction-only tests (layout, init) stay on the CPU."""
from __future__ import annotations

import pytest
import torch

from vlm.modeling.chunking import IMAGE, TEXT
from vlm.modeling.conceptmoe import compression_stats, concept_schedule

V = 2048


from conftest import left_padded, randomise_joint  # noqa: E402
from _device import dev, dtype_for, require_test_device, tol  # noqa: E402, F401


# causality ----------------------------------------------------------------------------------------
def _check_causal(model, ids, am, ts, chunked: bool):
    with torch.no_grad():
        base = model(ids, attention_mask=am)
        for t in ts:
            ids2 = ids.clone()
            ids2[:, t + 1] = (ids2[:, t + 1] + 1 + t) % (V - 1) + 1
            out = model(ids2, attention_mask=am)
            real = am[:, : t + 1].bool()
            torch.testing.assert_close(out.logits[:, : t + 1][real], base.logits[:, : t + 1][real],
                                       **tol(1e-5, 0), msg=f"logits at <= {t} changed")
            # the change itself is visible from t + 1 on (the test can fail)
            assert not torch.allclose(out.logits[:, t + 1:], base.logits[:, t + 1:], atol=1e-4)
            if chunked:
                assert torch.equal(out.boundary_mask[:, : t + 1], base.boundary_mask[:, : t + 1]), t
                torch.testing.assert_close(out.boundary_probs[:, : t + 1], base.boundary_probs[:, : t + 1],
                                           **tol(1e-6, 0))


@pytest.mark.device
def test_plain_moe_is_causal(tiny_model):
    ids, am = dev(left_padded())
    _check_causal(dev(tiny_model("tiny")), ids, am, [6, 9, 13, 18], chunked=False)


@pytest.mark.device
@pytest.mark.parametrize("merge", ["last", "sum"])
def test_conceptmoe_is_causal(tiny_model, make_decisive, merge):
    """Eval mode, decisive router, left padding: changing token t+1 changes no logit, boundary or
    probability at positions <= t (a "sum" concept is read only once complete)."""
    model = dev(randomise_joint(make_decisive(tiny_model("tiny_concept", concept_merge=merge), 3)))
    ids, am = dev(left_padded())
    with torch.no_grad():
        b = model(ids, attention_mask=am).boundary_mask
    assert 3 <= int(b[0].sum()) <= 17  # really chunked, not all / nothing
    _check_causal(model, ids, am, [5, 6, 8, 11, 14, 17, 18], chunked=True)


@pytest.mark.device
def test_conceptmoe_causal_with_loop_and_concept_width(tiny_model, make_decisive):
    model = dev(make_decisive(tiny_model("tiny_concept", concept_merge="sum", concept_hidden_size=32,
                                         concept_loop_layers=[0], concept_loop_times=2), 5))
    ids, am = dev(left_padded(T=16, pad=3))
    _check_causal(model, ids, am, [4, 9, 14], chunked=True)


# packing ------------------------------------------------------------------------------------------
@pytest.mark.device
@pytest.mark.parametrize("preset, merge", [("tiny", "last"), ("tiny_concept", "last"), ("tiny_concept", "sum")])
def test_packed_segments_do_not_interact(tiny_model, make_decisive, preset, merge):
    """Two packed segments in a row: each equals the segment run alone (positions restarting) -
    no attention, concept, concept-attention or EMA crossing."""
    model = tiny_model(preset, concept_merge=merge)
    if model.config.chunking:
        randomise_joint(make_decisive(model, 3))
    model = dev(model)
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(1, V, (1, 13), generator=g), torch.randint(1, V, (1, 11), generator=g)
    c, d = torch.randint(1, V, (1, 5), generator=g), torch.randint(1, V, (1, 19), generator=g)
    ids = torch.cat([torch.cat([a, b], 1), torch.cat([c, d], 1)])
    seg = torch.tensor([[0] * 13 + [1] * 11, [3] * 5 + [4] * 19])
    pos = torch.tensor([list(range(13)) + list(range(11)), list(range(5)) + list(range(19))])
    ids, seg, pos, a, b, c, d = dev(ids, seg, pos, a, b, c, d)
    with torch.no_grad():
        packed = model(ids, position_ids=pos, segment_ids=seg)
        alone = {k: model(x) for k, x in dict(a=a, b=b, c=c, d=d).items()}
    parts = {"a": (0, slice(0, 13)), "b": (0, slice(13, 24)), "c": (1, slice(0, 5)), "d": (1, slice(5, 24))}
    for name, (row, sl) in parts.items():
        torch.testing.assert_close(packed.logits[row, sl], alone[name].logits[0], **tol(1e-5, 0), msg=name)
        if model.config.chunking:
            assert torch.equal(packed.boundary_mask[row, sl], alone[name].boundary_mask[0]), name
    if model.config.chunking:
        assert int(packed.num_concepts.sum()) == sum(int(o.num_concepts.sum()) for o in alone.values())


def _packed_rows():
    """Two packed rows in the collate layout (segment ids 1, 2, 3 per sample, 0 = padding; positions
    restarting in each segment): row 0 = 7 + 9 + 8 tokens, row 1 = 5 + 12 + 4 tokens + 3 right pads."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, V, (2, 24), generator=g)
    seg = torch.tensor([[1] * 7 + [2] * 9 + [3] * 8, [1] * 5 + [2] * 12 + [3] * 4 + [0] * 3])
    am = (seg > 0).long()
    ids = ids * am
    pos = torch.zeros_like(seg)
    for r in range(2):
        for k in range(1, 4):
            sel = seg[r] == k
            pos[r, sel] = torch.arange(int(sel.sum()))
    return ids, am, seg, pos


def _bump(ids, r, t):
    ids2 = ids.clone()
    ids2[r, t] = (ids2[r, t] + 1 + t) % (V - 1) + 1
    return ids2


@pytest.mark.device
@pytest.mark.parametrize("preset, merge, router", [
    ("tiny", "last", None),  # chunking off: the plain MoE
    ("tiny_concept", "last", "decisive"), ("tiny_concept", "sum", "decisive"),
    ("tiny_concept", "last", "random"), ("tiny_concept", "sum", "random"),
])
def test_packed_rows_are_causal_and_segments_isolated(tiny_model, make_decisive, preset, merge, router):
    """Packed rows (``segment_ids``), eval mode, changing one token at (row r, position t):
    - causality: no logit (boundary, probability) at any position < t of row r changes, whether t
      is in the same segment or starts a later one;
    - isolation: no logit (boundary, probability) of any OTHER segment of row r changes, including
      the later ones (a mask that ignored segment_ids would still be causal, but not this);
    - the change is visible at t itself (the test can fail).
    "random" keeps the default random router (boundary p strictly inside (0.5, 1), so the EMA is
    not trivial and a leak of it across segments would show); it is guarded so that no p sits
    within 1e-4 of 0.5 (a last-bit difference cannot flip a hard boundary)."""
    model = tiny_model(preset, concept_merge=merge)
    chunked = model.config.chunking
    if router == "decisive":
        make_decisive(model, 3)
    if chunked:
        randomise_joint(model)
    model = dev(model)
    ids, am, seg, pos = dev(*_packed_rows())
    kw = {"attention_mask": am, "position_ids": pos, "segment_ids": seg}
    with torch.no_grad():
        base = model(ids, **kw)
    if chunked:
        b, p = base.boundary_mask, base.boundary_probs
        inner = am.bool() & (pos > 0)
        assert 0 < int(b[inner].sum()) < int(inner.sum())  # really chunked inside the segments
        assert torch.equal(b[am.bool() & (pos == 0)], torch.ones_like(b[am.bool() & (pos == 0)]))
        if router == "random":
            assert float((p[inner] - 0.5).abs().min()) > 1e-4
            assert bool(((p[inner & b] > 0.5) & (p[inner & b] < 0.99)).all())
    # (row, position): mid-segment, a segment's first token, a segment's last token
    for r, t in [(0, 3), (0, 7), (0, 12), (0, 15), (0, 20), (1, 5), (1, 9), (1, 17), (1, 19)]:
        with torch.no_grad():
            out = model(_bump(ids, r, t), **kw)
        keep = am.bool().clone()
        keep[r] &= (torch.arange(24, device=keep.device) < t) | (seg[r] != seg[r, t])
        keep[1 - r] = am[1 - r].bool()  # the other row must not change at all
        msg = f"row {r} position {t} (segment {int(seg[r, t])}) changed logits it may not reach"
        torch.testing.assert_close(out.logits[keep], base.logits[keep], **tol(1e-5, 0), msg=msg)
        assert not torch.allclose(out.logits[r, t], base.logits[r, t], atol=1e-4)
        if chunked:
            assert torch.equal(out.boundary_mask[keep], base.boundary_mask[keep]), msg
            torch.testing.assert_close(out.boundary_probs[keep], base.boundary_probs[keep], **tol(1e-6, 0))


# layout -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dec, K, want", [(2, 4, [4, 5]), (2, 1, [5]), (2, 0, []), (1, 4, [5])])
def test_joint_projections_only_in_last_K_decoder_layers(tiny_model, dec, K, want):
    model = tiny_model("tiny_concept", num_hidden_layers=6, decoder_layers=dec, joint_decoding_layers=K)
    joint = [i for i, layer in enumerate(model.model.layers) if layer.attn.joint]
    assert joint == want
    names = [n for n, _ in model.named_parameters() if "_c_proj" in n]
    assert len(names) == 3 * len(want)
    for i in want:
        for proj in ("q_c_proj", "k_c_proj", "v_c_proj"):
            w = getattr(model.model.layers[i].attn, proj).weight
            assert torch.equal(w, torch.zeros_like(w)), (i, proj)  # zero-initialised by the HF init


def test_router_init_applied_by_hf_init(tiny_model):
    ident = tiny_model("tiny_concept", router_init="identity").model.chunker
    assert torch.equal(ident.q_proj.weight, torch.eye(64)) and torch.equal(ident.k_proj.weight, torch.eye(64))
    rnd = tiny_model("tiny_concept", router_init="random").model.chunker
    assert rnd.q_proj.weight.std().item() == pytest.approx(64 ** -0.5, rel=0.1)


def test_layer_schedule_and_widths(tiny_model):
    model = tiny_model("tiny_concept", num_hidden_layers=6, encoder_layers=1, decoder_layers=1,
                       concept_loop_layers=[0, 2], concept_loop_times=3, concept_hidden_size=32, concept_top_k=4)
    assert concept_schedule(model.config) == [0, 0, 0, 1, 2, 2, 2, 3]
    m = model.model
    assert len(m.encoder) == 1 and len(m.concept_model) == 4 and len(m.decoder) == 1
    assert all(layer.attn.q_proj.in_features == 32 and layer.ffn.top_k == 4 for layer in m.concept_model)
    assert all(layer.attn.q_proj.in_features == 64 and layer.ffn.top_k == 2 for layer in (*m.encoder, *m.decoder))
    assert m.concept_in.weight.shape == (32, 64) and m.concept_out.weight.shape == (64, 32)
    out = model(torch.randint(1, V, (2, 12)))
    assert len(out.tokens_per_expert) == 1 + 8 + 1  # a looped layer runs (and is counted) each time


@pytest.mark.device
@pytest.mark.parametrize("overrides", [
    dict(concept_loop_layers=[1], concept_loop_times=2),
    dict(concept_hidden_size=32),
    dict(concept_hidden_size=96, concept_merge="sum", concept_loop_layers=[0], concept_loop_times=2),
])
def test_loop_and_concept_width_forward_backward(tiny_model, overrides):
    """Train mode, forward + backward: finite loss, every parameter gets a finite gradient (bf16 on
    CUDA: this is the bf16-safety check of the looped / narrow-concept paths)."""
    model = dev(tiny_model("tiny_concept", **overrides)).to(dtype_for(exact=False)).train()
    ids, am = dev(left_padded(T=16, pad=4))
    out = model(ids, attention_mask=am, labels=ids.masked_fill(am == 0, -100))
    assert torch.isfinite(out.loss) and out.ratio_loss > 0
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, missing
    assert model.model.chunker.q_proj.weight.grad.abs().sum() > 0
    if "concept_hidden_size" in overrides:
        assert model.model.concept_in.weight.grad.abs().sum() > 0


@pytest.mark.device
def test_lm_loss_reaches_router_through_ste(tiny_model):
    model = dev(tiny_model("tiny_concept", ratio_loss_weight=0.0)).train()
    ids = dev(torch.randint(1, V, (2, 16)))
    out = model(ids, labels=ids)
    out.lm_loss.backward()
    assert model.model.chunker.q_proj.weight.grad.abs().sum() > 0


def _router_grad(model, ids) -> torch.Tensor:
    """d lm_loss / d W_q of the chunk router (zeros where no path reaches it); train mode, boundary
    sampling reseeded so that every call sees the same boundaries."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(11)
    model(ids, labels=ids).lm_loss.backward()
    g = model.model.chunker.q_proj.weight.grad
    return torch.zeros_like(model.model.chunker.q_proj.weight) if g is None else g.detach().clone()


@pytest.mark.device
@pytest.mark.parametrize("merge", ["last", "sum"])
def test_lm_loss_reaches_router_through_ste_alone(tiny_model, monkeypatch, merge):
    """The router gets LM gradient by two paths: the EMA weights (p of each boundary token) and the
    STE factor STE(s_n) of every token. test_lm_loss_reaches_router_through_ste sees their sum, so it
    passes with the STE removed. Here the EMA path is cut (its p detached where dechunk takes it):
    the gradient that is left comes from the STE alone and must be nonzero; with the STE also
    replaced by a constant 1 nothing reaches the router (the cut is complete); and the two paths
    add up to the full gradient."""
    import vlm.modeling.conceptmoe as cm
    import vlm.modeling.dechunk as dc

    real_dechunk, real_ste = cm.dechunk, dc.ste
    model = dev(tiny_model("tiny_concept", ratio_loss_weight=0.0, concept_merge=merge)).train()
    ids = dev(torch.randint(1, V, (2, 16), generator=torch.Generator().manual_seed(3)))
    full = _router_grad(model, ids)

    def ema_cut(h, c_hat, concept_prob_BM, *args, **kwargs):
        return real_dechunk(h, c_hat, concept_prob_BM.detach(), *args, **kwargs)

    monkeypatch.setattr(cm, "dechunk", ema_cut)
    ste_only = _router_grad(model, ids)
    assert ste_only.abs().sum() > 1e-3 * full.abs().sum() > 0, "no LM gradient reaches the router via the STE"

    monkeypatch.setattr(dc, "ste", lambda s: torch.ones_like(s))  # STE removed: factor 1, no gradient
    assert torch.count_nonzero(_router_grad(model, ids)) == 0, "a path other than EMA / STE reaches the router"

    monkeypatch.setattr(cm, "dechunk", real_dechunk)
    ema_only = _router_grad(model, ids)
    monkeypatch.setattr(dc, "ste", real_ste)
    torch.testing.assert_close(ste_only + ema_only, full, **tol(1e-5, 1e-4))


# identities with the plain MoE --------------------------------------------------------------------
@pytest.mark.device
def test_chunking_off_is_exactly_the_plain_moe(tiny_model):
    plain = dev(tiny_model("tiny", seed=7))
    off = dev(tiny_model("tiny_concept", seed=7, **{"chunking.enabled": False}))
    assert {k: v.shape for k, v in off.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}
    ids, am = dev(left_padded())
    with torch.no_grad():
        a, b = plain(ids, attention_mask=am), off(ids, attention_mask=am)
    assert torch.equal(a.logits, b.logits)
    assert b.boundary_mask is None and b.compression is None and b.ratio_loss.item() == 0.0


@pytest.mark.device
def test_conversion_identity_every_token_a_concept(tiny_model):
    """boundary_mode="all" + concept_merge="last" with the plain model's weights (strict=False for
    the chunker / joint projections, which are zero) reproduces the plain model's logits."""
    plain = tiny_model("tiny", seed=7)
    concept = tiny_model("tiny_concept", seed=8, boundary_mode="all", concept_merge="last")
    res = concept.load_state_dict(plain.state_dict(), strict=False)
    assert not res.unexpected_keys
    assert sorted(res.missing_keys) == sorted(
        ["model.chunker.q_proj.weight", "model.chunker.k_proj.weight"]
        + [f"model.layers.3.attn.{p}_c_proj.weight" for p in "qkv"])
    plain, concept = dev(plain, concept)
    ids, am = dev(left_padded())
    with torch.no_grad():
        a, b = plain(ids, attention_mask=am), concept(ids, attention_mask=am)
    real = am.bool()
    torch.testing.assert_close(b.logits[real], a.logits[real], **tol(1e-5, 0))
    assert b.compression["ratio"] == 1.0
    # and a non-trivial chunking does change the model (the identity is not vacuous)
    concept.model.chunker.cfg.boundary_mode = "fixed"
    with torch.no_grad():
        c = concept(ids, attention_mask=am)
    assert not torch.allclose(c.logits[real], a.logits[real], atol=1e-3)


# stats --------------------------------------------------------------------------------------------
@pytest.mark.device
def test_compression_stats():
    b = torch.tensor([[1, 0, 1, 0, 0, 0], [0, 0, 1, 1, 0, 1]], dtype=torch.bool)
    valid = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    mod = torch.tensor([[IMAGE, IMAGE, IMAGE, IMAGE, TEXT, TEXT], [TEXT, TEXT, TEXT, TEXT, TEXT, IMAGE]])
    b, valid, mod = dev(b, valid, mod)
    s = compression_stats(b, valid, mod)
    assert s["ratio_per_sample"].tolist() == pytest.approx([3.0, 4 / 3])
    assert s["ratio"] == pytest.approx(10 / 5)
    assert s["ratio_image"] == pytest.approx(5 / 3) and s["ratio_text"] == pytest.approx(5 / 2)
