"""Triton kernels of the experts' SwiGLU activation on the fused gate/up layout, as two custom ops.

liger-kernel's SwiGLU (``silu(a) * b``) does not fit the experts: it wants a, b and the output at one
row stride (ours are the two halves of ``gu_S2I`` [S, 2I] and an [S, I] output), it has no routing
weight, and its backward overwrites a and b with their gradients but gives neither ``h`` (the down
projection's weight gradient needs it) nor the routing weights' gradient. These do:
  ``conceptmoe::swiglu_fwd(gu, rw)``: ``h_SI = silu(gate) * up * rw`` (one read of gu, one write);
  ``conceptmoe::swiglu_bwd(gu, g_hw, rw)``: ``h * rw``, ``d gu`` [S, 2I] and ``d rw`` [S] in one pass,
from ``g_hw`` = d loss / d (h * rw). fp32 math, one rounding at each store. Custom ops: Dynamo sees
one opaque call (a compiled block stays one graph). ``expert_mlp_fused.py`` uses them; the torch
reference is ``expert_mlp.GroupedSwiGLU`` (tests/unit/modeling/test_fused_kernels.py, under
``TRITON_INTERPRET=1`` on CPU).
"""
from __future__ import annotations

import torch

try:  # (transformers' remote-code import check skips a try block: this file loads only where triton imports)
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover
    raise ImportError("vlm.modeling.swiglu_triton needs triton (fused_kernels picks it only when it imports)") from e

BR = 16  # rows per program
BI = 128  # columns per tile


@triton.jit
def _fwd(gu_ptr, rw_ptr, h_ptr, S, I, HAS_RW: tl.constexpr, BR: tl.constexpr, BI: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BI + tl.arange(0, BI)
    m = (r < S)[:, None] & (c < I)[None, :]
    base = r[:, None] * (2 * I) + c[None, :]
    gate = tl.load(gu_ptr + base, mask=m, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + base + I, mask=m, other=0.0).to(tl.float32)
    h = gate * tl.sigmoid(gate) * up
    if HAS_RW:
        h = h * tl.load(rw_ptr + r, mask=r < S, other=0.0).to(tl.float32)[:, None]
    tl.store(h_ptr + r[:, None] * I + c[None, :], h.to(h_ptr.dtype.element_ty), mask=m)


@triton.jit
def _bwd(gu_ptr, ghw_ptr, rw_ptr, hw_ptr, ggu_ptr, grw_ptr, S, I,
         HAS_RW: tl.constexpr, BR: tl.constexpr, BI: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rm = r < S
    rw = tl.load(rw_ptr + r, mask=rm, other=0.0).to(tl.float32) if HAS_RW else tl.full([BR], 1.0, tl.float32)
    acc = tl.zeros([BR], dtype=tl.float32)  # d rw = sum_i g_hw * h
    for c0 in range(0, I, BI):
        c = c0 + tl.arange(0, BI)
        m = rm[:, None] & (c < I)[None, :]
        base = r[:, None] * (2 * I) + c[None, :]
        gate = tl.load(gu_ptr + base, mask=m, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + base + I, mask=m, other=0.0).to(tl.float32)
        ghw = tl.load(ghw_ptr + r[:, None] * I + c[None, :], mask=m, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        h = silu * up
        acc += tl.sum(ghw * h, 1)
        gh = ghw * rw[:, None]  # d loss / d h
        tl.store(hw_ptr + r[:, None] * I + c[None, :], (h * rw[:, None]).to(hw_ptr.dtype.element_ty), mask=m)
        g_gate = gh * up * sig * (1.0 + gate * (1.0 - sig))
        tl.store(ggu_ptr + base, g_gate.to(ggu_ptr.dtype.element_ty), mask=m)
        tl.store(ggu_ptr + base + I, (gh * silu).to(ggu_ptr.dtype.element_ty), mask=m)
    if HAS_RW:
        tl.store(grw_ptr + r, acc.to(grw_ptr.dtype.element_ty), mask=rm)


def _rw_arg(gu: torch.Tensor, rw: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    return (gu, False) if rw is None else (rw.contiguous(), True)  # gu: a pointer never read


# under TRITON_INTERPRET=1 (the CPU tests) the ops get their own names: the compiled ones stay as they are
SUFFIX = "_interpreted" if triton.knobs.runtime.interpret else ""


def _define_ops():
    """Defined once per process (also when this file loads twice, as an export's remote code)."""
    if hasattr(torch.ops.conceptmoe, f"swiglu_fwd{SUFFIX}"):
        return getattr(torch.ops.conceptmoe, f"swiglu_fwd{SUFFIX}"), getattr(torch.ops.conceptmoe, f"swiglu_bwd{SUFFIX}")

    @torch.library.custom_op(f"conceptmoe::swiglu_fwd{SUFFIX}", mutates_args=())
    def swiglu_fwd(gu: torch.Tensor, rw: torch.Tensor | None) -> torch.Tensor:
        gu = gu.contiguous()
        S, I = gu.shape[0], gu.shape[1] // 2
        h = gu.new_empty(S, I)
        rw_t, has_rw = _rw_arg(gu, rw)
        _fwd[(triton.cdiv(S, BR), triton.cdiv(I, BI))](gu, rw_t, h, S, I, HAS_RW=has_rw, BR=BR, BI=BI)
        return h

    @swiglu_fwd.register_fake
    def _(gu, rw):
        return gu.new_empty(gu.shape[0], gu.shape[1] // 2)

    @torch.library.custom_op(f"conceptmoe::swiglu_bwd{SUFFIX}", mutates_args=())
    def swiglu_bwd(gu: torch.Tensor, g_hw: torch.Tensor, rw: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gu, g_hw = gu.contiguous(), g_hw.contiguous()
        S, I = g_hw.shape
        hw, g_gu = g_hw.new_empty(S, I), torch.empty_like(gu)
        g_rw = gu.new_empty(0) if rw is None else torch.empty_like(rw)  # (no rw: nothing to write)
        rw_t, has_rw = _rw_arg(gu, rw)
        _bwd[(triton.cdiv(S, BR),)](gu, g_hw, rw_t, hw, g_gu, g_rw, S, I, HAS_RW=has_rw, BR=BR, BI=BI)
        return hw, g_gu, g_rw

    @swiglu_bwd.register_fake
    def _(gu, g_hw, rw):
        S, I = g_hw.shape
        return g_hw.new_empty(S, I), torch.empty_like(gu), gu.new_empty(0) if rw is None else torch.empty_like(rw)

    return getattr(torch.ops.conceptmoe, f"swiglu_fwd{SUFFIX}"), getattr(torch.ops.conceptmoe, f"swiglu_bwd{SUFFIX}")


swiglu_fwd, swiglu_bwd = _define_ops()
