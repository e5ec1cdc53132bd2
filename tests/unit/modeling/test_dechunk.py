"""vlm/modeling/dechunk.py: EMA (loop vs blocked scan), STE, the causal read rule, dechunk; and the
chunk step continued token by token through a ``ChunkCarry`` (cached decoding) == over the whole
sequence (boundaries, forced switches, concept merge, EMA).

Every test runs on ``VLM_TEST_DEVICE`` in fp32 (tests/_device.py)."""
from __future__ import annotations

import pytest
import torch

from vlm.modeling.configuration_conceptmoe import ChunkingConfig
from vlm.modeling.chunking import IMAGE, TEXT, ChunkCarry, ChunkModule
from vlm.modeling.dechunk import dechunk, ema_reference, ema_scan, read_index, ste

from _device import DEVICE, dev, require_test_device, tol  # noqa: E402, F401

pytestmark = pytest.mark.device


def _probs(B: int, M: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(B, M, generator=g)
    p[:, 0] = 1.0  # a sequence's first concept is forced
    p[:, 3::7] = 1.0  # exact 1 (forced boundaries, segment starts)
    p[:, 5::11] = 0.0  # exact 0
    p[:, 2::13] = 1e-7  # tiny
    return p


@pytest.mark.parametrize("M, block", [(1, 64), (7, 64), (64, 64), (150, 64), (150, 16), (37, 8)])
def test_scan_equals_reference_forward_and_grads(M, block):
    """Long M over several blocks, M not a multiple of the block, p exactly 0 and 1: equal within
    1e-5, and so are the gradients w.r.t. the concepts and w.r.t. p."""
    B, D = 2, 8
    c = dev(torch.randn(B, M, D, generator=torch.Generator().manual_seed(1)))
    p = dev(_probs(B, M))
    c1, p1 = c.clone().requires_grad_(), p.clone().requires_grad_()
    c2, p2 = c.clone().requires_grad_(), p.clone().requires_grad_()
    y1, y2 = ema_reference(c1, p1), ema_scan(c2, p2, block=block)
    torch.testing.assert_close(y2, y1, **tol(1e-5, 1e-5))
    g = dev(torch.randn(B, M, D, generator=torch.Generator().manual_seed(2)))
    (y1 * g).sum().backward()
    (y2 * g).sum().backward()
    torch.testing.assert_close(c2.grad, c1.grad, **tol(1e-5, 1e-5))
    torch.testing.assert_close(p2.grad, p1.grad, **tol(1e-5, 1e-5))
    assert p1.grad.abs().sum() > 0


def test_ema_recursion_by_hand():
    c = dev(torch.tensor([[[1.0], [3.0], [5.0]]]))
    p = dev(torch.tensor([[1.0, 0.5, 0.0]]))
    want = dev(torch.tensor([[[1.0], [2.0], [2.0]]]))  # 1; 0.5*3 + 0.5*1; 0*5 + 1*2
    for fn in (ema_reference, ema_scan):
        torch.testing.assert_close(fn(c, p), want)


def test_ste_forward_exactly_one_gradient_one():
    s = torch.tensor([0.0, 1e-8, 0.3, 0.5, 0.999999, 1.0], device=DEVICE, requires_grad=True)
    out = ste(s)
    assert torch.equal(out, torch.ones_like(s))
    out.sum().backward()
    assert torch.equal(s.grad, torch.ones_like(s))


def test_read_index_rules():
    index = dev(torch.tensor([[-1, 0, 0, 1, 2, 2]]))
    idx, ok = read_index(index, None, None, "last")
    assert idx.tolist() == [[0, 0, 0, 1, 2, 2]] and ok.tolist() == [[False, True, True, True, True, True]]
    idx, ok = read_index(index, None, None, "sum")  # previous (completed) chunk
    assert ok.tolist() == [[False, False, False, True, True, True]]
    assert idx[ok].tolist() == [0, 1, 1]
    # "sum" never reads a chunk of another packed segment
    seg_M = dev(torch.tensor([[0, 0, 1]]))
    seg_T = dev(torch.tensor([[0, 0, 0, 0, 1, 1]]))
    idx, ok = read_index(index, seg_M, seg_T, "sum")
    assert ok.tolist() == [[False, False, False, True, False, False]]


@pytest.mark.parametrize("merge", ["last", "sum"])
def test_dechunk_output_and_gradient_to_p(merge):
    B, T, M, D = 1, 6, 3, 4
    h = dev(torch.randn(B, T, D))
    c_hat = dev(torch.randn(B, M, D))
    b = dev(torch.tensor([[True, False, True, False, False, True]]))
    index = b.long().cumsum(1) - 1
    p = torch.tensor([[1.0, 0.2, 0.8, 0.1, 0.3, 0.9]], device=DEVICE, requires_grad=True)
    cp = dev(torch.tensor([[1.0, 0.8, 0.9]]))
    z, read = dechunk(h, c_hat, cp, p, b, index, merge)
    ema = ema_reference(c_hat, cp)
    src = index[0] if merge == "last" else index[0] - 1
    for t in range(T):
        want = ema[0, src[t]] if src[t] >= 0 else torch.zeros(D, device=DEVICE)
        torch.testing.assert_close(read[0, t], want)
        torch.testing.assert_close(z[0, t], h[0, t] + want)  # STE factor is exactly 1
    # the gradient reaches p through the STE: d z / d p = +read (boundary) or -read (non-boundary)
    (g,) = torch.autograd.grad(z.sum(), p)
    sign = torch.where(b, 1.0, -1.0)
    torch.testing.assert_close(g, sign * read.sum(-1).detach())
    z2, _ = dechunk(h, c_hat, cp, p, b, index, merge, scan=False)
    torch.testing.assert_close(z2, z, **tol(1e-6, 1e-6))


# the chunk step continued through a carry ----------------------------------------------------------
def _fractional_sequence(B: int, T: int, D: int, seed: int = 0):
    """Hidden states, boundaries (first token forced) and fractional p: boundaries in [0.6, 0.9],
    the other tokens in [0.1, 0.4]."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, D, generator=g)
    b = torch.rand(B, T, generator=g) < 0.4
    b[:, 0] = True
    u = torch.rand(B, T, generator=g) * 0.3
    p = torch.where(b, 0.6 + u, 0.1 + u)
    p[:, 0] = 1.0
    return dev(h, b, p)


@pytest.mark.parametrize("merge", ["last", "sum"])
def test_carry_merge_and_ema_equal_whole_sequence(merge):
    """A prefix through ``form_concepts`` + ``ChunkCarry.start``, then one token at a time through
    ``ChunkCarry.merge`` / ``update_ema``: each token reads what ``dechunk``'s read rule gives over
    the whole sequence (the concept model is stood in for by a fixed per-concept map)."""
    B, T, D, T0 = 2, 16, 4, 5
    h, b, p = _fractional_sequence(B, T, D)
    W = dev(torch.randn(D, D, generator=torch.Generator().manual_seed(1)))
    def concept_model(x):
        return torch.tanh(x @ W)
    ch = dev(ChunkModule(D, ChunkingConfig(concept_merge=merge)))
    valid = torch.ones_like(b)
    con = ch.form_concepts(h, b, p, valid, None)
    ema = ema_scan(concept_model(con.x_BMD), con.prob_BM)
    idx, ok = read_index(con.index_BT, None, None, merge)
    want = ema.gather(1, idx[..., None].expand(-1, -1, D)) * ok[..., None]
    pre = ch.form_concepts(h[:, :T0], b[:, :T0], p[:, :T0], valid[:, :T0], None)
    carry = ChunkCarry()
    carry.start(pre, concept_model(pre.x_BMD), merge)
    torch.testing.assert_close(carry.read(), want[:, T0 - 1], **tol(1e-6, 1e-6))
    for t in range(T0, T):
        concept, weight = carry.merge(merge, h[:, t], b[:, t], p[:, t])
        carry.update_ema(concept_model(concept), weight, b[:, t])
        torch.testing.assert_close(carry.read(), want[:, t], **tol(1e-6, 1e-6), msg=f"token {t}")
    assert 0 < int(b[:, T0:].sum()) < b[:, T0:].numel()


@pytest.mark.parametrize("policy", ["joint", "split_at_switch"])
def test_boundaries_through_carry_equal_whole_sequence(policy):
    """``ChunkModule.boundaries`` over a prefix (starting the carry), then one token at a time,
    gives the boundaries and p of one call over the whole sequence, modality switches included."""
    B, T, D, T0 = 2, 14, 8, 4
    ch = dev(ChunkModule(D, ChunkingConfig(router_init="random", modality_policy=policy))).eval()
    h = dev(torch.randn(B, T, D, generator=torch.Generator().manual_seed(2)))
    mod = dev(torch.tensor([[TEXT] * 2 + [IMAGE] * 5 + [TEXT] * 3 + [IMAGE] * 2 + [TEXT] * 2,
                            [IMAGE] * 6 + [TEXT] * 8]))
    valid = torch.ones(B, T, dtype=torch.bool, device=h.device)
    pos = torch.arange(T, device=h.device)[None].expand(B, T)
    with torch.no_grad():
        b_all, p_all = ch.boundaries(h, valid, pos, None, mod)
        carry = ChunkCarry()
        bs, ps = ch.boundaries(h[:, :T0], valid[:, :T0], pos[:, :T0], None, mod[:, :T0], carry=carry)
        bs, ps = [bs], [ps]
        for t in range(T0, T):
            b_t, p_t = ch.boundaries(h[:, t:t + 1], valid[:, :1], pos[:, t:t + 1], None, mod[:, t:t + 1], carry=carry)
            bs.append(b_t), ps.append(p_t)
    free = p_all < 1.0
    assert float((p_all[free] - 0.5).abs().min()) > 1e-4  # no p on the edge of a flip
    assert torch.equal(torch.cat(bs, 1), b_all)
    torch.testing.assert_close(torch.cat(ps, 1), p_all, **tol(1e-6, 1e-6))
    switch = mod[:, 1:] != mod[:, :-1]
    assert bool(b_all[:, 1:][switch].all()) == (policy == "split_at_switch")
