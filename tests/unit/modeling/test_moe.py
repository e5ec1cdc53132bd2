"""vlm/modeling/moe.py: dropless sorted dispatch vs the per-expert loop, stats, padding.

Every test runs on ``VLM_TEST_DEVICE`` (fp32; see tests/_device.py); on CUDA the bf16 sorted dispatch
(``torch._grouped_mm``) is also checked against the fp32 loop. Host syncs: tests/unit/modeling/test_host_syncs.py."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from vlm.modeling.configuration_conceptmoe import MoEConfig
from vlm.modeling import moe as moe_mod
from vlm.modeling.moe import MoEFeedForward, TokenMask, grouped_swiglu, init_moe_weights
from vlm.modeling.syncs import counting

from _device import DEVICE, cuda_only, dev, require_test_device, tol  # noqa: E402, F401

pytestmark = pytest.mark.device

D = 32


def make_moe(shared: int = 0, dispatch: str = "sorted", seed: int = 0, **kw) -> MoEFeedForward:
    torch.manual_seed(seed)
    cfg = MoEConfig(num_experts=6, top_k=2, moe_intermediate_size=24, shared_expert_intermediate_size=shared,
                    moe_dispatch=dispatch, **kw)
    moe = MoEFeedForward(D, cfg)
    init_moe_weights(moe, std=0.2)
    torch.nn.init.normal_(moe.router.weight, std=0.5)
    return moe.to(DEVICE)


def dense_reference(moe: MoEFeedForward, x_ND: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, combined with the normalised top-k softmax weights."""
    probs = (x_ND @ moe.router.weight.T).softmax(-1)
    w, e = probs.topk(moe.top_k, -1)
    if moe.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    h = F.silu(torch.einsum("nd,edi->nei", x_ND, moe.w_gate)) * torch.einsum("nd,edi->nei", x_ND, moe.w_up)
    y_NED = torch.einsum("nei,eid->ned", h, moe.w_down)
    gate_NE = torch.zeros_like(probs).scatter(1, e, w)
    out = (gate_NE[..., None] * y_NED).sum(1)
    if moe.shared is not None:
        out = out + moe.shared(x_ND)
    return out


@pytest.mark.parametrize("shared", [0, 16])
def test_forward_matches_dense_reference(shared):
    moe = make_moe(shared)
    x = dev(torch.randn(3, 7, D))
    y, stats = moe(x)
    ref = dense_reference(moe, x.reshape(-1, D)).view(3, 7, D)
    assert y.abs().mean() > 1e-2  # not trivially zero
    torch.testing.assert_close(y, ref, **tol(1e-5, 1e-5))


@pytest.mark.parametrize("shared", [0, 16])
@pytest.mark.parametrize("padded", [False, True])
def test_sorted_equals_loop_forward_and_grads(shared, padded):
    sorted_moe = make_moe(shared, "sorted")
    loop_moe = make_moe(shared, "loop")
    loop_moe.load_state_dict(sorted_moe.state_dict())
    x = torch.randn(2, 9, D)
    valid = torch.ones(2, 9, dtype=torch.bool)
    if padded:
        valid[0, :4] = False
        valid[1, -2:] = False
    x, valid = dev(x, valid)
    outs = []
    for moe in (sorted_moe, loop_moe):
        xi = x.clone().requires_grad_()
        y, stats = moe(xi, valid if padded else None)
        g_out = dev(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
        loss = (y * g_out).sum() + stats.lb_loss + stats.z_loss
        grads = torch.autograd.grad(loss, [xi] + list(moe.parameters()))
        outs.append((y, stats, grads))
    (y1, s1, g1), (y2, s2, g2) = outs
    torch.testing.assert_close(y1, y2, **tol(1e-5, 1e-5))
    assert torch.equal(s1.tokens_per_expert, s2.tokens_per_expert)
    torch.testing.assert_close(s1.lb_loss, s2.lb_loss, **tol(1e-6, 1e-6))
    names = ["input"] + [n for n, _ in sorted_moe.named_parameters()]
    assert len(g1) == len(names) == 1 + 3 + (3 if shared else 0)  # input, router, 2 expert stacks, shared
    for name, a, b in zip(names, g1, g2):
        assert a.abs().sum() > 0, name  # every weight gets a gradient
        torch.testing.assert_close(a, b, **tol(1e-5, 1e-5), msg=name)


def test_tokens_per_expert_counts_real_assignments():
    moe = make_moe()
    x = dev(torch.randn(2, 10, D))
    _, stats = moe(x)
    assert stats.tokens_per_expert.dtype == torch.long
    assert int(stats.tokens_per_expert.sum()) == 2 * 10 * moe.top_k
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[0, :3] = False
    _, stats = moe(x, dev(valid))
    assert int(stats.tokens_per_expert.sum()) == 17 * moe.top_k


@pytest.mark.parametrize("shared", [0, 8])
def test_padding_excluded_from_outputs_and_stats(shared):
    """Padding tokens are never routed: real outputs and all stats equal a run on the real tokens
    alone, whatever the padding holds; padding outputs are zero (without a shared expert, from the
    routed sum alone: no output mask)."""
    moe = make_moe(shared=shared)
    x = torch.randn(2, 8, D)
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[1, :5] = False
    x, valid = dev(x, valid)
    y, stats = moe(x, valid)
    x_junk = x.clone()
    x_junk[~valid] = 100.0 * torch.randn_like(x_junk[~valid])
    y_junk, stats_junk = moe(x_junk, valid)
    y_real, stats_real = moe(x[valid][None])
    torch.testing.assert_close(y[valid], y_real[0], **tol(1e-6, 1e-6))
    torch.testing.assert_close(y_junk, y, atol=0, rtol=0)
    assert torch.equal(y[~valid], torch.zeros_like(y[~valid]))
    y_tm, stats_tm = moe(x, TokenMask.of(valid))  # a stack's mask prepared once: the same figures
    assert torch.equal(y_tm, y) and torch.equal(stats_tm.lb_loss, stats.lb_loss) and torch.equal(stats_tm.z_loss, stats.z_loss)
    for s in (stats, stats_junk):
        torch.testing.assert_close(s.lb_loss, stats_real.lb_loss)
        torch.testing.assert_close(s.z_loss, stats_real.z_loss)
        assert torch.equal(s.tokens_per_expert, stats_real.tokens_per_expert)


def test_losses_match_formula():
    moe = make_moe()
    x = dev(torch.randn(4, 5, D))
    _, stats = moe(x)
    x_ND = x.reshape(-1, D)
    logits = x_ND @ moe.router.weight.T
    probs = logits.softmax(-1)
    top = probs.topk(moe.top_k, -1).indices
    frac = torch.bincount(top.reshape(-1), minlength=moe.num_experts).float() / top.numel()
    lb = moe.num_experts * (frac * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).pow(2).mean()
    torch.testing.assert_close(stats.lb_loss, lb)
    torch.testing.assert_close(stats.z_loss, z)


def test_lb_loss_gradient_reaches_router():
    moe = make_moe()
    _, stats = moe(dev(torch.randn(2, 6, D)))
    (g,) = torch.autograd.grad(stats.lb_loss + stats.z_loss, [moe.router.weight])
    assert g.abs().sum() > 0


def test_all_padding_row_block():
    """A batch whose mask is all False (e.g. an empty micro-batch) still runs: zeros out, finite losses."""
    moe = make_moe()
    y, stats = moe(*dev(torch.randn(1, 4, D), torch.zeros(1, 4, dtype=torch.bool)))
    assert torch.equal(y, torch.zeros_like(y))
    assert torch.isfinite(stats.lb_loss) and torch.isfinite(stats.z_loss)
    assert int(stats.tokens_per_expert.sum()) == 0


@pytest.mark.parametrize("padded", [False, True])
def test_backward_keeps_one_top_k_buffer(padded):
    """Issue 27 item 2: the sorted dispatch keeps ONE [N * K, D] tensor for the backward, the grouped
    GEMM's input: the routing weights scale the expert MLP's activation, so no expert output is kept
    for their gradient, and the sum back per token keeps only indices."""
    moe = make_moe()
    N = 2 * 16
    x = dev(torch.randn(2, 16, D)).requires_grad_()
    valid = dev(torch.ones(2, 16, dtype=torch.bool))
    valid[0, :3] = False
    storages = set()

    def pack(t):
        if t.dim() == 2 and tuple(t.shape) == (N * moe.top_k, D) and t.is_floating_point():
            storages.add(t.untyped_storage().data_ptr())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, _ = moe(x, valid if padded else None)
    assert len(storages) == 1, len(storages)
    y.sum().backward()  # the saved graph still runs


@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_gate_and_up_are_one_stored_weight_and_one_gemm(monkeypatch, grad):
    """Issue 27 item 3: gate and up are ONE stored parameter [E, D, 2I] and the sorted dispatch runs two
    grouped GEMMs (gate + up, then down), not three, at any rows per expert; no copy of the weight
    is made or kept for the backward (the one [E, D, 2I] tensor saved is the parameter itself);
    outputs and every gradient equal the per-expert loop."""
    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(a[1].shape) or grouped_mm(*a, **k))
    sorted_moe, loop_moe = make_moe(8, "sorted"), make_moe(8, "loop")
    loop_moe.load_state_dict(sorted_moe.state_dict())
    E, I = sorted_moe.num_experts, sorted_moe.w_down.shape[1]
    assert {n: tuple(p.shape) for n, p in sorted_moe.named_parameters() if n.startswith("w_")} == \
        {"w_gate_up": (E, D, 2 * I), "w_down": (E, I, D)}
    x = dev(torch.randn(1, 3, D))  # decode-sized: fewer rows than experts
    wide = []

    def pack(t):
        if tuple(t.shape[-2:]) == (D, 2 * I) and not loop:  # the loop reference saves per-expert views
            wide.append(t.data_ptr())
        return t
    outs = []
    for moe in (sorted_moe, loop_moe):
        loop = moe is loop_moe
        xi = x.clone().requires_grad_(grad)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.set_grad_enabled(grad):
            if moe is sorted_moe:
                cat = torch.cat
                monkeypatch.setattr(torch, "cat", lambda ts, *a, **k: cat(ts, *a, **k) if all(
                    t.shape[-1] != I for t in ts) else pytest.fail("a gate / up weight concatenation"))
            y, st = moe(xi)
            monkeypatch.setattr(torch, "cat", cat)
        if moe is sorted_moe:
            assert [tuple(s[-1:]) for s in calls] == [(2 * I,), (D,)], calls  # gate+up, down
        outs.append((y, torch.autograd.grad((y ** 2).sum() + st.lb_loss, [xi] + list(moe.parameters()))
                     if grad else ()))
    assert set(wide) == ({sorted_moe.w_gate_up.data_ptr()} if grad else set())
    (y1, g1), (y2, g2) = outs
    torch.testing.assert_close(y1, y2, **tol(1e-5, 1e-5))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, **tol(1e-5, 1e-5))


def test_a_state_dict_with_separate_gate_and_up_loads_fused():
    """Checkpoints written before the fused weight hold ``w_gate`` / ``w_up`` [E, D, I]: they load into
    ``w_gate_up`` (gate columns first), with no missing or unexpected key; a lone half is unexpected."""
    moe = make_moe(8)
    I = moe.w_down.shape[1]
    old = {k: v for k, v in moe.state_dict().items() if k != "w_gate_up"}
    old["w_gate"], old["w_up"] = moe.w_gate_up[..., :I].clone(), moe.w_gate_up[..., I:].clone()
    fresh = make_moe(8)
    torch.nn.init.zeros_(fresh.w_gate_up)
    result = fresh.load_state_dict(old, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(fresh.w_gate_up, moe.w_gate_up)
    assert torch.equal(fresh.w_gate, old["w_gate"]) and torch.equal(fresh.w_up, old["w_up"])
    lone = {k: v for k, v in old.items() if k != "w_up"}
    result = make_moe(8).load_state_dict(lone, strict=False)
    assert result.missing_keys == ["w_gate_up"] and result.unexpected_keys == ["w_gate"]


def test_model_level_dispatch_equivalence(tiny_model):
    sorted_m = tiny_model("tiny")
    loop_m = tiny_model("tiny", moe_dispatch="loop")
    loop_m.load_state_dict(sorted_m.state_dict())
    sorted_m, loop_m = dev(sorted_m, loop_m)
    ids = dev(torch.randint(1, 2048, (2, 12)))
    torch.testing.assert_close(sorted_m(ids).logits, loop_m(ids).logits, **tol(1e-5, 1e-5))


@pytest.mark.parametrize("sizes, tail", [([5, 0, 3, 9, 0, 1], 0), ([0, 0, 0, 0, 0, 18], 0),
                                         ([18, 0, 0, 0, 0, 0], 0), ([4, 2, 0, 7, 1, 0], 5), ([0] * 6, 4)],
                         ids=["mixed", "all-last", "all-first", "mixed+5-outside", "all-outside"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "routing-weighted"])
def test_grouped_swiglu_equals_split_loop(monkeypatch, sizes, tail, weighted):
    """The device-offset grouped path (``torch._grouped_mm``; a C++ loop on the CPU) == the split loop
    over host-read segment sizes (the fallback where no grouped GEMM exists, one named host sync),
    fp32 forward and backward (input, the two expert stacks, the per-row routing weights), empty
    segments included. ``tail`` rows after the last segment belong to no expert (padding): zero
    outputs, zero input and routing-weight gradients even where the caller sends them a gradient,
    and no part in the weight gradients. Without a gradient: the same outputs. Without tail rows,
    ``tail=False`` (no masks) gives the same figures."""
    E, I = len(sizes), 24
    n = sum(sizes)
    g = torch.Generator().manual_seed(0)
    x = dev(torch.randn(n + tail, D, generator=g))
    ws = [dev(torch.randn(E, D, 2 * I, generator=g) * 0.2), dev(torch.randn(E, I, D, generator=g) * 0.2)]
    ws.append(dev(torch.rand(n + tail, generator=g)) if weighted else None)
    offs = dev(torch.tensor(sizes).cumsum(0).to(torch.int32))
    g_out = dev(torch.randn(n + tail, D, generator=g))
    outs = []
    for grouped in (True, False):
        monkeypatch.setattr(moe_mod, "GROUPED_MM", grouped)
        leaves = [t.clone().requires_grad_() for t in [x] + ws if t is not None]
        with counting() as named:
            y = grouped_swiglu(leaves[0], offs, *leaves[1:3], leaves[3] if weighted else None)
            grads = torch.autograd.grad((y * g_out).sum(), leaves)
        assert named == ({} if grouped else {moe_mod.SPLIT_SYNC: 1})
        assert y.shape == (n + tail, D)
        assert not y[n:].any() and not grads[0][n:].any() and not (weighted and grads[3][n:].any())
        with torch.no_grad():
            torch.testing.assert_close(grouped_swiglu(x, offs, *ws), y, rtol=0, atol=0)
        if grouped and not tail:  # every row in a segment: the caller may spare the masks, same figures
            y_nt = grouped_swiglu(leaves[0], offs, *leaves[1:3], leaves[3] if weighted else None, tail=False)
            grads_nt = torch.autograd.grad((y_nt * g_out).sum(), leaves)
            assert torch.equal(y_nt, y) and all(torch.equal(a, b) for a, b in zip(grads_nt, grads))
        outs.append((y, grads))
    (y1, g1), (y2, g2) = outs
    torch.testing.assert_close(y1, y2, **tol(1e-5, 1e-5))
    for name, a, b in zip(["input", "w_gate_up", "w_down", "routing weights"], g1, g2):
        torch.testing.assert_close(a, b, **tol(1e-5, 1e-5), msg=name)


def test_split_fallback_dispatch_equals_loop(monkeypatch):
    """The whole module on the split fallback (padding sorted after the last segment) == the
    per-expert loop reference, forward and backward."""
    monkeypatch.setattr(moe_mod, "GROUPED_MM", False)
    sorted_moe, loop_moe = make_moe(8, "sorted"), make_moe(8, "loop")
    loop_moe.load_state_dict(sorted_moe.state_dict())
    x = dev(torch.randn(2, 9, D))
    valid = dev(torch.ones(2, 9, dtype=torch.bool))
    valid[1, :6] = False
    outs = []
    for moe in (sorted_moe, loop_moe):
        xi = x.clone().requires_grad_()
        y, st = moe(xi, valid)
        grads = torch.autograd.grad((y ** 2).sum() + st.lb_loss, [xi] + list(moe.parameters()))
        outs.append((y, st, grads))
    (y1, s1, g1), (y2, s2, g2) = outs
    torch.testing.assert_close(y1, y2, **tol(1e-5, 1e-5))
    assert torch.equal(s1.tokens_per_expert, s2.tokens_per_expert)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, **tol(1e-5, 1e-5))


def test_grouped_mm_flops_equal_the_split_loop_matmuls(monkeypatch):
    """``FlopCounterMode`` counts the grouped dispatch (our formula for ``torch._grouped_mm``) exactly
    as the split loop's plain matmuls, forward and forward + backward, padding (rows outside every
    group) excluded, gate and up as one GEMM."""
    from torch.utils.flop_counter import FlopCounterMode
    moe = make_moe()
    x = dev(torch.randn(2, 9, D))
    valid = dev(torch.ones(2, 9, dtype=torch.bool))
    valid[0, :5] = False
    counted = []
    for grouped in (True, False):
        monkeypatch.setattr(moe_mod, "GROUPED_MM", grouped)
        for backward in (False, True):
            xi = x.clone().requires_grad_(backward)
            with FlopCounterMode(display=False) as fc:
                y, _ = moe(xi, valid)
                if backward:
                    (y ** 2).sum().backward()
            counted.append(fc.get_total_flops())
    real = 13 * moe.top_k
    router = 2 * 18 * D * moe.num_experts
    assert counted[0] == router + real * 2 * 3 * D * 24  # gate, up, down
    assert counted[:2] == counted[2:]


def test_grouped_mm_probe_is_not_counted(monkeypatch):
    """The grouped GEMM probe (``features.grouped_mm_ok``, on a process's first MoE call) runs outside
    the caller's dispatch modes: a ``FlopCounterMode`` around that first call counts the MoE only,
    as around any later one."""
    from torch.utils.flop_counter import FlopCounterMode
    from vlm.modeling import features
    moe = make_moe()
    x = dev(torch.randn(2, 9, D))

    def counted() -> int:
        with FlopCounterMode(display=False) as fc:
            moe(x)
        return fc.get_total_flops()

    monkeypatch.setattr(features, "_GROUPED", {})  # as in a fresh process: the next call probes
    first = counted()
    assert first == counted() == 2 * 18 * D * moe.num_experts + 18 * moe.top_k * 2 * 3 * D * 24
    assert list(features._GROUPED) == [(x.device.type, x.dtype)] or not moe_mod.GROUPED_MM


# CUDA bf16: torch._grouped_mm ---------------------------------------------------------------------
def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


# bf16 rounds to 8 mantissa bits (~2e-3 relative); the grouped GEMM accumulates in fp32 and rounds
# its three outputs, so the whole SwiGLU is ~1e-2 relative off the fp32 loop at worst
BF16_REL = 2e-2


@cuda_only
@pytest.mark.parametrize("n_tokens, padded", [(256, False), (240, True), (3, False)],
                         ids=["256tok", "240tok-padded", "3tok-empty-experts"])
def test_grouped_mm_bf16_matches_fp32_loop(monkeypatch, n_tokens, padded):
    """On CUDA in bf16 the sorted dispatch is one ``torch._grouped_mm`` per projection. Same routing
    (the bf16 module's), same bf16-rounded weights and inputs: its outputs and the gradients w.r.t.
    the input, the routing weights and the three expert stacks equal the fp32 per-expert loop
    within bf16 accuracy. 3 tokens x top-2 over 8 experts leaves most groups empty (offs repeat).
    The full module (router, stats, padding) in bf16 then matches the bf16 loop module."""
    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or grouped_mm(*a, **k))
    Dg, E, I = 64, 8, 48  # 16-byte aligned rows, as the grouped GEMM requires
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=E, top_k=2, moe_intermediate_size=I, moe_dispatch="sorted")
    moe = MoEFeedForward(Dg, cfg)
    init_moe_weights(moe, std=0.1)
    torch.nn.init.normal_(moe.router.weight, std=0.5)
    moe_bf = moe.to(DEVICE, torch.bfloat16)
    ref = copy.deepcopy(moe_bf).float()  # exactly the bf16 values, in fp32
    x = dev(torch.randn(n_tokens, Dg)).bfloat16()

    with torch.no_grad():
        _, _, w_NK, e_NK = moe_bf.route(x)
    xg, wg = x.clone().requires_grad_(), w_NK.clone().requires_grad_()
    xr, wr = x.float().requires_grad_(), w_NK.clone().requires_grad_()
    y_g, counts_g = moe_bf.experts_sorted(xg, wg, e_NK)
    assert len(calls) == 2, "the bf16 CUDA dispatch did not take torch._grouped_mm (gate + up, down)"
    y_r, counts_r = ref.experts_loop(xr, wr, e_NK)
    assert y_g.dtype == torch.bfloat16 and torch.equal(counts_g, counts_r)
    assert (counts_g == 0).any() if n_tokens == 3 else (counts_g > 0).all()
    assert _rel_err(y_g, y_r) < BF16_REL, _rel_err(y_g, y_r)
    torch.testing.assert_close(y_g.float(), y_r, **tol(0, dtype=torch.bfloat16))
    g_out = dev(torch.randn(y_r.shape, generator=torch.Generator().manual_seed(1)))
    grads_g = torch.autograd.grad((y_g.float() * g_out).sum(), [xg, wg, moe_bf.w_gate_up, moe_bf.w_down])
    grads_r = torch.autograd.grad((y_r * g_out).sum(), [xr, wr, ref.w_gate_up, ref.w_down])
    for name, a, b in zip(["input", "routing weights", "w_gate_up", "w_down"], grads_g, grads_r):
        assert torch.isfinite(a).all(), name
        if b.abs().sum() == 0:  # an expert stack no token reached (3 tokens): zero both ways
            assert a.abs().sum() == 0, name
            continue
        assert _rel_err(a, b) < BF16_REL, (name, _rel_err(a, b))

    # the whole module in bf16 (router, padding, stats): grouped dispatch == the bf16 loop
    loop_bf = copy.deepcopy(moe_bf)
    loop_bf.dispatch = "loop"
    valid = None
    if padded:
        valid = torch.ones(2, n_tokens // 2, dtype=torch.bool)
        valid[0, :7] = False
        valid[1, -5:] = False
        valid = dev(valid)
    x_BTD = x.view(2, n_tokens // 2, Dg) if padded else x[None]
    with torch.no_grad():
        (y1, s1), (y2, s2) = moe_bf(x_BTD, valid), loop_bf(x_BTD, valid)
    assert torch.equal(s1.tokens_per_expert, s2.tokens_per_expert)
    assert torch.isfinite(s1.lb_loss) and torch.isfinite(s1.z_loss)
    assert _rel_err(y1, y2) < BF16_REL, _rel_err(y1, y2)
    if padded:
        assert torch.equal(y1[~valid], torch.zeros_like(y1[~valid]))


def test_normalize_rows_is_the_plain_quotient_forward_and_backward():
    """The top-k weights' normalisation: the plain quotient's figures forward (bit-equal) and its
    gradient (gradcheck in fp64; fp32 to rounding)."""
    from vlm.modeling.moe import NormalizeRows

    g = torch.Generator().manual_seed(0)
    w = torch.rand(40, 3, dtype=torch.float64, generator=g).add(0.1).requires_grad_()
    assert torch.autograd.gradcheck(NormalizeRows.apply, (w,))
    w32, g_out = w.detach().float().requires_grad_(), torch.randn(40, 3, generator=g)
    ref = w32 / w32.sum(-1, keepdim=True)
    (g_ref,) = torch.autograd.grad((ref * g_out).sum(), w32)
    out = NormalizeRows.apply(w32)
    (g_got,) = torch.autograd.grad((out * g_out).sum(), w32)
    assert torch.equal(out, ref)
    torch.testing.assert_close(g_got, g_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("padded", [False, True])
def test_router_z_is_the_masked_logsumexp_square_sum(padded):
    """The z-loss sum with its gradient from the router's probabilities == autograd through
    logsumexp and the square (fp64 gradcheck; fp32 to rounding); padding rows give nothing."""
    from vlm.modeling.moe import RouterZ

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 5, dtype=torch.float64, generator=g).mul(3).requires_grad_()
    pad = (torch.arange(12) % 4 == 0) if padded else None

    def z(lg):
        return RouterZ.apply(lg, lg.softmax(-1), pad)
    assert torch.autograd.gradcheck(z, (logits,))
    lg32 = logits.detach().float().requires_grad_()
    lse = torch.logsumexp(lg32, -1)
    ref = (lse.pow(2) if pad is None else torch.where(pad, 0.0, lse.pow(2))).sum()
    (g_ref,) = torch.autograd.grad(ref, lg32)
    got = z(lg32)
    (g_got,) = torch.autograd.grad(got, lg32)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_got, g_ref, rtol=1e-5, atol=1e-6)
    if padded:
        assert not g_got[pad].any()
