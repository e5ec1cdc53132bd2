"""vlm/modeling/attention.py: RoPE, GQA vs a manual repeat-kv reference, masks, the KV cache.

Every test runs on ``VLM_TEST_DEVICE`` in fp32 (tests/_device.py)."""
from __future__ import annotations

import math

import pytest
import torch

from vlm.modeling.configuration_conceptmoe import AttentionConfig
from vlm.modeling.attention import (Attention, KVCache, RMSNorm, apply_rope, causal_mask, rope_cos_sin)
from vlm.modeling.varlen import DocLayout

from _device import DEVICE, dev, require_test_device, tol  # noqa: E402, F401

pytestmark = pytest.mark.device

CFG = AttentionConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)


def make_attn(joint: bool = False, seed: int = 0) -> Attention:
    torch.manual_seed(seed)
    attn = Attention(CFG, CFG.hidden_size, joint=joint)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return attn.to(DEVICE)


def manual_attention(attn: Attention, x, positions, allowed_BTT, concept=None):
    """Straightforward GQA: project, rotate, repeat k/v per group, masked softmax."""
    B, T, _ = x.shape
    H, Hkv, Dh = attn.n_heads, attn.n_kv, attn.head_dim
    q, k, v = x @ attn.q_proj.weight.T, x @ attn.k_proj.weight.T, x @ attn.v_proj.weight.T
    if concept is not None:
        q = q + concept @ attn.q_c_proj.weight.T
        k = k + concept @ attn.k_c_proj.weight.T
        v = v + concept @ attn.v_c_proj.weight.T
    q = q.view(B, T, H, Dh).transpose(1, 2)
    k = k.view(B, T, Hkv, Dh).transpose(1, 2)
    v = v.view(B, T, Hkv, Dh).transpose(1, 2)
    inv = 1.0 / (CFG.rope_theta ** (torch.arange(0, Dh, 2, device=positions.device).float() / Dh))
    ang = positions.float()[..., None] * inv  # [B, T, Dh/2]
    cos, sin = ang.cos(), ang.sin()

    def rot(t):  # rotate pairs (i, i + Dh/2)
        a, b = t[..., : Dh // 2], t[..., Dh // 2:]
        c, s = cos[:, None], sin[:, None]
        return torch.cat([a * c - b * s, a * s + b * c], -1)

    q, k = rot(q), rot(k)
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(Dh)
    scores = scores.masked_fill(~allowed_BTT[:, None], float("-inf"))
    out = scores.softmax(-1) @ v
    return out.transpose(1, 2).reshape(B, T, H * Dh) @ attn.o_proj.weight.T


def test_rmsnorm_formula():
    norm = RMSNorm(8, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    norm, x = dev(norm, torch.randn(3, 8))
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), ref)


def test_rope_is_a_relative_rotation():
    Dh = 16
    q, k = dev(torch.randn(1, 1, 1, Dh), torch.randn(1, 1, 1, Dh))

    def dot(pq, pk):
        cq, sq = rope_cos_sin(torch.tensor([[pq]], device=DEVICE), Dh, 10000.0, torch.float32)
        ck, sk = rope_cos_sin(torch.tensor([[pk]], device=DEVICE), Dh, 10000.0, torch.float32)
        rq, rk = apply_rope(q, cq, sq), apply_rope(k, ck, sk)
        torch.testing.assert_close(rq.norm(), q.norm())  # a rotation
        return float((rq * rk).sum())

    assert dot(5, 3) == pytest.approx(dot(105, 103), abs=1e-4)  # depends on pq - pk only
    assert dot(5, 3) != pytest.approx(dot(5, 4), abs=1e-3)
    assert dot(0, 0) == pytest.approx(float((q * k).sum()), abs=1e-5)  # position 0 = identity


def test_causal_mask_semantics():
    assert causal_mask(None, None, 5, DEVICE) is None
    valid = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    seg = torch.tensor([[0, 0, 0, 0, 0], [0, 0, 1, 1, 1]])
    m = causal_mask(*dev(valid, seg), 5, DEVICE)
    assert m.shape == (2, 1, 5, 5) and m.dtype == torch.bool and m.device == DEVICE
    m = m.cpu()
    for b in range(2):
        for i in range(5):
            for j in range(5):
                want = (j <= i and bool(valid[b, j]) and seg[b, i] == seg[b, j]) or i == j
                assert bool(m[b, 0, i, j]) == want, (b, i, j)
    # a fully padded row keeps its diagonal, so SDPA stays finite
    m = causal_mask(dev(torch.zeros(1, 3, dtype=torch.bool)), None, 3, DEVICE)
    assert torch.equal(m[0, 0], dev(torch.eye(3, dtype=torch.bool)))


@pytest.mark.parametrize("impl", ["dense", "varlen"])
@pytest.mark.parametrize("case", ["causal", "padded", "packed"])
def test_gqa_matches_manual_repeat_kv(case, impl):
    attn = make_attn()
    B, T = 2, 7
    x = torch.randn(B, T, CFG.hidden_size)
    valid = torch.ones(B, T, dtype=torch.bool)
    seg = None
    pos = torch.arange(T)[None].expand(B, T)
    if case == "padded":
        valid[1, :3] = False
        pos = (valid.long().cumsum(1) - 1).clamp(min=0)
    if case == "packed":
        seg = torch.tensor([[0] * 3 + [1] * 4, [0] * 7])
        pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3], list(range(7))])
    x, valid, seg, pos = dev(x, valid, seg, pos)
    mask = causal_mask(valid if case == "padded" else None, seg, T, x.device)
    allowed = dev(torch.ones(T, T, dtype=torch.bool).tril()[None].expand(B, T, T)) if mask is None else mask[:, 0]
    if impl == "varlen" and mask is not None:  # the per-document path, against the same reference
        mask_or_layout = DocLayout.build(valid if case == "padded" else None, seg)
    else:
        mask_or_layout = mask
    out = attn(x, rope_cos_sin(pos, attn.head_dim, CFG.rope_theta, x.dtype), mask=mask_or_layout)
    ref = manual_attention(attn, x, pos, allowed)
    rows = valid  # padding query rows are irrelevant (they only see themselves)
    torch.testing.assert_close(out[rows], ref[rows], **tol(1e-5, 1e-5))


def test_joint_projections():
    attn = make_attn(joint=True)
    x, c = dev(torch.randn(1, 5, CFG.hidden_size), torch.randn(1, 5, CFG.hidden_size))
    pos = dev(torch.arange(5)[None])
    cs = rope_cos_sin(pos, attn.head_dim, CFG.rope_theta, x.dtype)
    allowed = dev(torch.ones(5, 5, dtype=torch.bool).tril()[None])
    torch.testing.assert_close(attn(x, cs, concept_BTD=c), manual_attention(attn, x, pos, allowed, c),
                               **tol(1e-5, 1e-5))
    assert not torch.allclose(attn(x, cs, concept_BTD=c), attn(x, cs))
    for lin in (attn.q_c_proj, attn.k_c_proj, attn.v_c_proj):
        torch.nn.init.zeros_(lin.weight)
    torch.testing.assert_close(attn(x, cs, concept_BTD=c), attn(x, cs))


@pytest.mark.parametrize("impl", ["dense", "varlen"])
def test_cached_decoding_matches_full_attention(impl):
    """Prefill a left-padded prompt into the cache (dense mask or DocLayout), then step token by
    token: same outputs as the full forward with the dense mask."""
    attn = make_attn()
    B, T, P = 2, 9, 5
    x = torch.randn(B, T, CFG.hidden_size)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[0, :2] = False
    x, valid = dev(x, valid)
    pos = (valid.long().cumsum(1) - 1).clamp(min=0)
    full = attn(x, rope_cos_sin(pos, attn.head_dim, CFG.rope_theta, x.dtype),
                mask=causal_mask(valid, None, T, x.device))
    cache = KVCache(B, attn.n_kv, T + 1, attn.head_dim, x.device, x.dtype)
    outs = [attn(x[:, :P], rope_cos_sin(pos[:, :P], attn.head_dim, CFG.rope_theta, x.dtype),
                 mask=causal_mask(valid[:, :P], None, P, x.device) if impl == "dense" else
                 DocLayout.build(valid[:, :P], None), cache=cache,
                 fill=(valid[:, :P], torch.full((B,), P, device=DEVICE)))]
    assert cache.num_entries().tolist() == [P - 2, P]
    for t in range(P, T):
        outs.append(attn(x[:, t:t + 1], rope_cos_sin(pos[:, t:t + 1], attn.head_dim, CFG.rope_theta, x.dtype),
                         cache=cache))
        cache.advance()
    step = torch.cat(outs, 1)
    torch.testing.assert_close(step[valid], full[valid], **tol(1e-5, 1e-5))
    assert cache.num_entries().tolist() == [T - 2, T]


def test_kv_cache_commit_per_row():
    cache = KVCache(2, 1, 4, 2, DEVICE, torch.float32)
    t = lambda x: torch.tensor(x, device=DEVICE)  # noqa: E731
    full = lambda v: torch.full((2, 1, 1, 2), v, device=DEVICE)  # noqa: E731
    cache.fill(full(1.0), full(1.0), t([[True], [True]]), t([1, 1]))
    k, v, valid = cache.step(full(2.0), full(2.0))
    assert valid.tolist() == [[True, True], [True, True]]  # the step sees its own new entry
    cache.advance(t([True, False]))
    assert cache.len_B.tolist() == [2, 1] and cache.num_entries().tolist() == [2, 1]
    assert cache.size == 2  # the host bound: one more per step
    k, v, valid = cache.step(full(3.0), full(3.0))
    assert k[1, 0, 1].tolist() == [3.0, 3.0]  # the discarded slot is overwritten
    assert valid.tolist() == [[True, True, True], [True, True, False]]
    cache.advance(t([False, True]), size=2)  # the host knows the longest row (the decode step's read)
    assert cache.num_entries().tolist() == [2, 2] and cache.size == 2
    assert cache.nbytes() == 4 * (1 * 2 * 4 * 2)
    cache.step(full(0.0), full(0.0))
    cache.advance()
    cache.step(full(0.0), full(0.0))
    cache.advance()
    with pytest.raises(ValueError, match="full"):
        cache.step(full(0.0), full(0.0))
    with pytest.raises(ValueError, match="capacity"):
        cache.fill(*dev(torch.zeros(2, 1, 5, 2), torch.zeros(2, 1, 5, 2), torch.ones(2, 5), torch.tensor([5, 5])))
