"""vlm/modeling/generation.py: cached decoding == repeated full forwards, the concept cache, sampling
(``generate`` is transformers' GenerationMixin over a ConceptCache: tests/unit/modeling/test_generate_hf.py).

Routers: "decisive" (p exactly 0 or 1, conftest) and "fractional" (``fractional`` below: p spread
over (0, 1) a margin away from 0.5, so the EMA carry (1 - p) * ema and the EMA weight of each concept
are compared too). Every test runs on ``VLM_TEST_DEVICE`` in fp32 (tests/_device.py); models are
built and modified on the CPU, then moved; sampling is seeded with torch.manual_seed."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from vlm.modeling.chunking import IMAGE, TEXT
from vlm.modeling.modeling_conceptmoe import ConceptMoEForCausalLM
from vlm.modeling.moe import MoEFeedForward

V = 2048


from conftest import randomise_joint  # noqa: E402
from conftest import left_padded as _left_padded  # noqa: E402
from _device import DEVICE, dev, generator, require_test_device, tol  # noqa: E402, F401

pytestmark = pytest.mark.device


def left_padded(B: int = 2, T: int = 12, pad: int = 4, seed: int = 1):
    return dev(_left_padded(B, T, pad, seed))


# The fractional router: hidden dims 0..2 carry one of five vectors v (text token: class id % 4,
# image token: class 4), and p_n = 0.5 * (1 - cos(v_{class(n)}, R v_{class(n-1)})). Every one of the
# 25 class pairs gives p in [0.14, 0.36] U [0.63, 0.86] (checked in ``fractional``).
ROUTER_V = torch.tensor([[0.53, 0.84, -0.14], [-0.46, 0.61, 0.64], [-0.50, -0.56, 0.66], [0.46, -0.61, -0.64],
                         [0.52, 0.56, -0.65]])
ROUTER_R = torch.tensor([[0.62, 0.63, -0.47], [0.78, -0.46, 0.43], [0.05, -0.63, -0.77]])
MARGIN = ((0.1, 0.4), (0.6, 0.9))


def in_margin(p: torch.Tensor) -> torch.Tensor:
    return ((p > MARGIN[0][0]) & (p < MARGIN[0][1])) | ((p > MARGIN[1][0]) & (p < MARGIN[1][1]))


@torch.no_grad()
def fractional(lm: ConceptMoEForCausalLM, projector=None, scale: float = 0.05) -> ConceptMoEForCausalLM:
    """Give ``lm`` the fractional router. Dims 0..2 of the chunker's input are exactly scale * v: the
    token embeddings (and the projector's bias for image tokens, with its weight rows there zeroed)
    write them and the encoder layers' output rows there are zeroed; W_q reads them, W_k through R."""
    V, R = ROUTER_V, ROUTER_R
    P = 0.5 * (1 - F.cosine_similarity(V[:, None], (V @ R.T)[None], dim=-1))
    assert bool(in_margin(P).all()), P
    inner = lm.model
    emb = inner.embed_tokens.weight
    emb[:, :3] = scale * V[torch.arange(emb.shape[0]) % 4]
    for layer in inner.encoder:
        layer.attn.o_proj.weight[:3] = 0
        ffn = layer.ffn
        if isinstance(ffn, MoEFeedForward):
            ffn.w_down[:, :, :3] = 0
            if ffn.shared is not None:
                ffn.shared.down_proj.weight[:3] = 0
        else:
            ffn.down_proj.weight[:3] = 0
    ch = inner.chunker
    ch.q_proj.weight.zero_()
    ch.q_proj.weight[:3, :3] = torch.eye(3)
    ch.k_proj.weight.zero_()
    ch.k_proj.weight[:3, :3] = R
    if projector is not None:
        last = projector.proj[-1] if isinstance(projector.proj, nn.Sequential) else projector.proj
        last.weight[:3] = 0
        last.bias[:3] = scale * V[4]
    return lm


def check_fractional(out, valid_BT) -> None:
    """The router really was fractional: every p of a real, unforced token lies in the margin, and
    the boundaries' p (the EMA weights) take several values."""
    p, b = out.boundary_probs, out.boundary_mask
    free = valid_BT.bool() & (p < 1.0)
    assert bool(in_margin(p[free]).all()), p[free]
    weights = p[free & b]
    assert weights.numel() >= 4 and float(weights.max() - weights.min()) > 0.1, weights
    assert int((free & ~b).sum()) >= 4


@torch.no_grad()
def greedy_by_full_forwards(model, ids, am, n, modality=None):
    for _ in range(n):
        kw = {} if modality is None else {"modality_ids": modality}
        nxt = model(ids, attention_mask=am, **kw).logits[:, -1].argmax(-1)
        ids = torch.cat([ids, nxt[:, None]], 1)
        am = torch.cat([am, torch.ones_like(am[:, :1])], 1)
        if modality is not None:
            modality = torch.cat([modality, torch.full_like(modality[:, :1], TEXT)], 1)
    return ids, am, modality


@torch.no_grad()
def cached_run(model, ids, am, tokens, modality=None):
    """Prefill ``ids`` and feed ``tokens`` [B, n] one by one. Returns the state, the logits after
    each step and the decode path's boundary mask over ids + tokens (from the concept-cache growth:
    a row's first concept layer cache grows by one exactly when a boundary fires)."""
    B, T = ids.shape
    state = model.start_decoding(B, T + tokens.shape[1] + 1)
    logits = [model.prefill(state, ids, attention_mask=am, modality_ids=modality)]
    bounds = []
    if model.config.chunking:
        bounds.append(model._last_prefill.boundary_BT)
        count = state.concept_caches[0].num_entries().clone()
    for t in range(tokens.shape[1]):
        logits.append(model.step(state, tokens[:, t]))
        if model.config.chunking:
            new = state.concept_caches[0].num_entries()
            assert bool(((new - count) <= 1).all())
            bounds.append((new > count)[:, None])
            count = new.clone()
    return state, torch.stack(logits, 1), (torch.cat(bounds, 1) if bounds else None)


CASES = [
    ("tiny", {}),
    ("tiny_concept", dict(concept_merge="last")),
    ("tiny_concept", dict(concept_merge="sum")),
    ("tiny_concept", dict(concept_merge="last", concept_loop_layers=[0], concept_loop_times=2,
                          concept_hidden_size=32)),
    ("tiny_concept", dict(concept_merge="sum", concept_loop_layers=[1], concept_loop_times=2,
                          concept_hidden_size=96)),
    ("tiny_concept", dict(concept_merge="sum", boundary_mode="fixed", num_hidden_layers=6, decoder_layers=2,
                          joint_decoding_layers=4)),
]


def check_cached_equals_full(model, ids, am, new, modality=None, fractional_p=False):
    """Batch 2, left padding, fp32: the cached path's logits after the prefill and after each fed
    token equal the full forward's at the same positions, and generate(do_sample=False) == argmax of
    repeated full forwards. For ConceptMoE the decode path's boundaries are checked first, and each
    concept layer's cache holds one entry per concept ("sum": per completed concept)."""
    ref_ids, ref_am, ref_mod = greedy_by_full_forwards(model, ids, am, new, modality)
    with torch.no_grad():
        full = model(ref_ids, attention_mask=ref_am, **({} if ref_mod is None else {"modality_ids": ref_mod}))
    state, step_logits, bounds = cached_run(model, ids, am, ref_ids[:, ids.shape[1]:], modality)
    if model.config.chunking:
        if fractional_p:
            check_fractional(full, ref_am)
        assert torch.equal(bounds, full.boundary_mask), "decode path and full forward chunk differently"
        sub = 1 if model.config.concept_merge == "sum" else 0
        for cache in state.concept_caches:
            assert torch.equal(cache.num_entries(), full.num_concepts - sub)
        assert len(state.concept_caches) == len(model.model.schedule)
        assert 0 < int(full.num_concepts.min()) < int(ref_am.sum(1).min())  # real compression
    T = ids.shape[1]
    torch.testing.assert_close(step_logits, full.logits[:, T - 1:], **tol(1e-4, 1e-4))
    out = model.generate(ids, attention_mask=am, max_new_tokens=new, do_sample=False, modality_ids=modality)
    assert out.shape == (2, T + new)
    assert torch.equal(out, ref_ids)
    assert not model.training
    return full


@pytest.mark.parametrize("preset, overrides", CASES, ids=[f"{p}-{o}" for p, o in CASES])
def test_greedy_generate_equals_full_forwards(tiny_model, make_decisive, preset, overrides):
    model = tiny_model(preset, **overrides)
    if model.config.chunking:
        randomise_joint(make_decisive(model, 3))
    check_cached_equals_full(dev(model), *left_padded(), 32)


FRACTIONAL_CASES = {
    "last": dict(concept_merge="last"),
    "sum": dict(concept_merge="sum"),
    "sum-loop-dc96": dict(concept_merge="sum", concept_loop_layers=[1], concept_loop_times=2, concept_hidden_size=96),
    "last-split": dict(concept_merge="last", modality_policy="split_at_switch"),
    "sum-split": dict(concept_merge="sum", modality_policy="split_at_switch"),
}


@pytest.mark.parametrize("overrides", FRACTIONAL_CASES.values(), ids=FRACTIONAL_CASES.keys())
def test_fractional_router_generate_equals_full_forwards(tiny_model, overrides):
    """Fractional p: the decode path's EMA carry (1 - p) * ema and each concept's EMA weight (for
    "sum" the p of the CLOSED chunk's boundary token) are compared with the full forward. With
    split_at_switch the prompt ends on image tokens, so the first generated token is a forced
    boundary (p = 1) whose chunk a fractional boundary closes later."""
    model = dev(fractional(randomise_joint(tiny_model("tiny_concept", **overrides))))
    ids, am = left_padded()
    mod = None
    if overrides.get("modality_policy") == "split_at_switch":
        mod = torch.full_like(ids, TEXT)
        mod[:, 6:] = IMAGE
    full = check_cached_equals_full(model, ids, am, 24, mod, fractional_p=True)
    if mod is not None:
        assert bool(full.boundary_mask[:, ids.shape[1]].all())


def test_split_at_switch_decoding(tiny_model, make_decisive):
    """A prompt ending on image tokens: the first generated (text) token is forced to a boundary on
    both paths."""
    model = dev(make_decisive(tiny_model("tiny_concept", modality_policy="split_at_switch"), 3))
    ids, am = left_padded()
    mod = torch.full_like(ids, TEXT)
    mod[:, 6:] = IMAGE
    full = check_cached_equals_full(model, ids, am, 8, mod)
    assert bool(full.boundary_mask[:, 12].all())


@pytest.mark.parametrize("key, value", [("boundary_mode", "fixed"), ("concept_merge", "sum"),
                                        ("modality_policy", "split_at_switch")])
def test_chunk_config_changed_after_loading(tiny_model, tmp_path, key, value):
    """Every path reads the live model config: after loading a saved model, changing one chunk
    setting on ``model.config`` changes the full forward, and cached decoding still equals it."""
    model = fractional(randomise_joint(tiny_model("tiny_concept", concept_merge="last")))
    model.save_pretrained(tmp_path)
    loaded = ConceptMoEForCausalLM.from_pretrained(tmp_path).float().eval()
    setattr(loaded.config, key, value)
    model, loaded = dev(model, loaded)
    ids, am = left_padded()
    mod = torch.full_like(ids, TEXT)
    mod[:, 6:] = IMAGE
    full = check_cached_equals_full(loaded, ids, am, 16, mod, fractional_p=key != "boundary_mode")
    with torch.no_grad():
        before = model(ids, attention_mask=am, modality_ids=mod)
    T = ids.shape[1]
    assert not torch.allclose(full.logits[:, :T][am.bool()], before.logits[am.bool()], atol=1e-3)


def test_sampling_reproducible(tiny_model, make_decisive):
    model = dev(make_decisive(tiny_model("tiny_concept"), 3))
    ids, am = left_padded()

    def run(seed, **kw):
        torch.manual_seed(seed)
        return model.generate(ids, attention_mask=am, max_new_tokens=16, do_sample=True, **kw)

    a, b = run(0, temperature=0.8, top_p=0.9), run(0, temperature=0.8, top_p=0.9)
    assert torch.equal(a, b)
    assert not torch.equal(a, run(1, temperature=0.8, top_p=0.9))
    greedy = model.generate(ids, attention_mask=am, max_new_tokens=16)
    assert not torch.equal(a, greedy)
    assert torch.equal(run(5, top_k=1), greedy)
    assert torch.equal(run(6, top_p=1e-6), greedy)


def test_eos_stops_and_pads(tiny_model):
    model = dev(tiny_model("tiny"))
    ids, am = left_padded()
    greedy = model.generate(ids, attention_mask=am, max_new_tokens=10)
    T = ids.shape[1]
    eos = int(greedy[0, T + 2])
    first = [next(i for i in range(T, T + 10) if greedy[r, i] == eos) if (greedy[r, T:] == eos).any() else None
             for r in range(2)]
    out = model.generate(ids, attention_mask=am, max_new_tokens=10, eos_token_id=eos, pad_token_id=0)
    assert out[0, first[0]] == eos and bool((out[0, first[0] + 1:] == 0).all())
    assert torch.equal(out[0, : first[0] + 1], greedy[0, : first[0] + 1])
    if first[1] is None:
        assert out.shape[1] == T + 10 and torch.equal(out[1], greedy[1])
    # a single (unpadded) row stops as soon as it emits eos
    one = model.generate(ids[:1], max_new_tokens=10, eos_token_id=eos)
    assert one.shape[1] == first[0] + 1 and int(one[0, -1]) == eos


def test_right_padding_refused(tiny_model):
    model = dev(tiny_model("tiny"))
    ids, am = left_padded()
    with pytest.raises(ValueError, match="left padding"):
        model.generate(ids, attention_mask=am.flip(1), max_new_tokens=2)


def test_concept_kv_cache_512_tokens(tiny_model, make_decisive):
    """512 greedy tokens, batch 1, decisive router: the concept caches hold exactly one entry per
    concept of a full forward over the whole sequence; the printed numbers are reported."""
    model = dev(make_decisive(tiny_model("tiny_concept", concept_merge="last"), 3))
    prompt = dev(torch.randint(1, V, (1, 16), generator=torch.Generator().manual_seed(0)))
    n = 512
    state = model.start_decoding(1, 16 + n + 1)
    seq = [prompt]
    with torch.no_grad():
        logits = model.prefill(state, prompt)
        for _ in range(n):
            nxt = logits.argmax(-1)
            seq.append(nxt[:, None])
            logits = model.step(state, nxt)
        seq = torch.cat(seq, 1)
        full = model(seq)
    tokens = int(state.token_caches[0].num_entries()[0])
    concepts = [int(c.num_entries()[0]) for c in state.concept_caches]
    tok_bytes = sum(c.nbytes() for c in state.token_caches) // len(state.token_caches)
    con_bytes = sum(c.nbytes() for c in state.concept_caches) // len(state.concept_caches)
    print(f"\n[generation] 512-token greedy generation (16-token prompt), decisive router: concept KV "
          f"entries per concept layer {concepts[0]} vs {tokens} tokens per token layer "
          f"(ratio {tokens / concepts[0]:.2f}; {con_bytes} vs {tok_bytes} bytes per layer)")
    assert tokens == 16 + n
    assert concepts == [int(full.num_concepts[0])] * len(state.concept_caches)
    assert concepts[0] < tokens


def _allocated_bytes(caches) -> int:
    return sum(c.k.numel() * c.k.element_size() + c.v.numel() * c.v.element_size() for c in caches)


def test_concept_caches_sized_at_capacity_over_R(tiny_model):
    """``boundary_mode: fixed``, R = 2, 16-token prompt + 1,000 greedy tokens, batch 1: each concept
    cache is allocated at ceil(capacity / 2) + 16 slots (the token caches: capacity), never grows, and
    holds exactly the full forward's concepts; the steps' logits equal the full forward's."""
    model = dev(tiny_model("tiny_concept", boundary_mode="fixed", target_ratio=2.0, concept_merge="last"))
    headroom = model.config.runtime.concept_headroom
    prompt = dev(torch.randint(1, V, (1, 16), generator=torch.Generator().manual_seed(0)))
    n = 1000
    capacity = 16 + n + 1
    state = model.start_decoding(1, capacity)
    planned = [c.capacity for c in state.concept_caches]
    assert planned == [-(-capacity // 2) + headroom] * len(planned)
    seq, steps = [prompt], []
    with torch.no_grad():
        logits = model.prefill(state, prompt)
        for _ in range(n):
            steps.append(logits)
            nxt = logits.argmax(-1)
            seq.append(nxt[:, None])
            logits = model.step(state, nxt)
        seq = torch.cat(seq, 1)
        full = model(seq)
    assert [c.capacity for c in state.concept_caches] == planned  # no growth
    assert [int(c.num_entries()[0]) for c in state.concept_caches] == [int(full.num_concepts[0])] * len(planned)
    torch.testing.assert_close(torch.stack(steps, 1), full.logits[:, 15:-1], **tol(1e-4, 1e-4))
    con, tok = _allocated_bytes(state.concept_caches), _allocated_bytes(state.token_caches)
    before = tok // len(state.token_caches) * len(state.concept_caches)  # concept caches at token capacity
    print(f"\n[generation] fixed R=2, {capacity} token slots: concept caches allocate {con} bytes "
          f"({con / before:.3f} of the {before} bytes at token capacity)")
    assert con / before <= 0.5 + (headroom + 1) / capacity


@pytest.mark.parametrize("merge", ["last", "sum"])
def test_concept_caches_grow_when_more_concepts_arrive(tiny_model, make_decisive, monkeypatch, merge):
    """Planned for R = 16 (target_ratio) with headroom 2 while the decisive router compresses ~3x:
    the concept caches grow at the prefill and during decoding, and cached decoding stays exact
    (``check_cached_equals_full``: boundaries, entries per concept, logits, generate)."""
    from vlm.modeling import generation

    grown = []
    real_grow = generation.ConceptKVCache.grow

    def spy(self, capacity):
        if capacity > self.capacity:
            grown.append((self.capacity, capacity))
        real_grow(self, capacity)
    monkeypatch.setattr(generation.ConceptKVCache, "grow", spy)
    model = dev(make_decisive(tiny_model("tiny_concept", concept_merge=merge, target_ratio=16.0), 3))
    model.config.runtime.concept_headroom = 2
    ids, am = left_padded(B=2, T=20, pad=3)
    check_cached_equals_full(model, ids, am, 30)
    planned = -(-(20 + 30 + 1) // 16) + 2
    assert grown and grown[0][0] == planned, grown
    assert any(new == generation.grown_capacity(old, 2) for old, new in grown), grown  # a decoding step found it full


def test_concept_cache_grows_in_small_steps():
    """Issue 27 item 4: planned for 4,096 token positions at R = 2, a cache that receives the concepts
    of R = 1.98 (a few more than planned) grows by a small step, not to twice its size: its
    allocation stays under 0.6x of a token cache's; the held entries survive every growth."""
    from vlm.modeling.generation import ConceptKVCache, concept_capacity, grown_capacity

    tokens = 4096
    cache = ConceptKVCache(1, 1, concept_capacity(tokens, 2.0, 16), 2, torch.device("cpu"), torch.float32, headroom=16)
    planned = cache.capacity
    n = math.ceil(tokens / 1.98)
    for i in range(n):
        cache.reserve()  # between steps, as decode_step does
        cache.step(torch.full((1, 1, 1, 2), float(i)), torch.full((1, 1, 1, 2), -float(i)))
        cache.advance()
    assert n > planned and int(cache.num_entries()[0]) == n
    assert torch.equal(cache.k[0, 0, :n, 0], torch.arange(n, dtype=torch.float32))
    assert cache.capacity == grown_capacity(planned, 16) and cache.capacity / tokens < 0.6, cache.capacity
    assert grown_capacity(16, 16) == 32 and grown_capacity(1000, 16) == 1000 + 64  # whole pages of 16 slots
