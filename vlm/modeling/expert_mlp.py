"""The grouped SwiGLU expert MLP as one autograd function over the stored fused gate/up weight, the
routing weights folded in, and a backward that recomputes the activation product instead of keeping it.

The experts keep gate and up as ONE parameter ``w_gate_up`` [E, D, 2I] (gate columns first), so
``x_SD @ w_gate_up`` per expert segment is one grouped GEMM [S, 2I] (one wider GEMM beats two: 0.6x
their time on CPU) with no per-step weight copy, and its weight gradient is one GEMM writing the
parameter's own layout. Each row's routing weight ``rw_S`` scales the activation [S, I] before the
down projection (``(h * w) W_d == w * (h W_d)``): half the width of scaling the output [S, D], and no
[S, D] output to keep for the weight's gradient. Saved for the backward: the input, the gate / up
projections [S, 2I] and the routing weights (the weights are parameters, alive anyway);
``silu(gate)`` and the product ([S, I] each) are recomputed.
Rows from ``offs[-1]`` on belong to no expert: their outputs and every gradient they would give
(input rows, routing weights) are zero, and they take no part in the weight gradients; a caller that
knows there are none (``tail=False``: no padding) spares the masks. The plain
reference is ``grouped_swiglu_reference`` (per-expert loop; tests/unit/modeling/test_moe.py compares).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .grouped_mm import grouped_mm


def _outside(offs_E: torch.Tensor, rows: int) -> torch.Tensor:
    """[S, 1] bool: rows at or after the last segment end (no host read)."""
    return (torch.arange(rows, device=offs_E.device) >= offs_E[-1])[:, None]


class GroupedSwiGLU(torch.autograd.Function):
    """``grouped_mm(silu(x W_g) * (x W_u) * rw, W_d)`` per segment (``offs_E``: int32 segment ends),
    ``[W_g | W_u] = w_gate_up_ED2I``; ``rw_S`` None: unweighted; ``tail`` False: every row lies in a
    segment (offs[-1] == rows), so no row is masked."""

    @staticmethod
    def forward(ctx, x_SD, offs_E, w_gate_up_ED2I, w_down_EID, rw_S, tail: bool = True):
        gu_S2I = grouped_mm(x_SD, w_gate_up_ED2I, offs=offs_E)
        gate_SI, up_SI = gu_S2I.chunk(2, -1)
        h_SI = F.silu(gate_SI).mul_(up_SI)
        if rw_S is not None:
            h_SI.mul_(rw_S[:, None])
        y_SD = grouped_mm(h_SI, w_down_EID, offs=offs_E)
        outside_S1 = _outside(offs_E, x_SD.shape[0]) if tail else None
        if tail:
            y_SD.masked_fill_(outside_S1, 0.0)
        ctx.save_for_backward(x_SD, offs_E, w_gate_up_ED2I, w_down_EID, gu_S2I, rw_S, outside_S1)
        return y_SD

    @staticmethod
    def backward(ctx, g_SD):
        x_SD, offs_E, w_gate_up_ED2I, w_down_EID, gu_S2I, rw_S, outside_S1 = ctx.saved_tensors
        g_SD = g_SD.contiguous()
        gate_SI, up_SI = gu_S2I.chunk(2, -1)
        silu_SI = F.silu(gate_SI)  # as the forward computed it
        h_SI = silu_SI * up_SI
        g_hw_SI = grouped_mm(g_SD, w_down_EID.transpose(-2, -1), offs=offs_E)  # d loss / d (h * rw)
        g_rw = None
        if rw_S is not None:
            if ctx.needs_input_grad[4]:
                g_rw = (g_hw_SI * h_SI).sum(-1)
                if outside_S1 is not None:
                    g_rw.masked_fill_(outside_S1[:, 0], 0.0)
            h_SI.mul_(rw_S[:, None])
            g_hw_SI.mul_(rw_S[:, None])  # now d loss / d h
        g_down = None
        if ctx.needs_input_grad[3]:
            g_down = grouped_mm(h_SI.t(), g_SD, offs=offs_E)  # [E, I, D]
        del h_SI
        # the gate's gradient through silu by torch's own silu backward (one op); the two halves are
        # written separately and joined by one cat (Dynamo traces no ``out=`` into a strided view;
        # the cat is where inductor writes them)
        g_up_SI = g_hw_SI * silu_SI
        del silu_SI
        g_gate_SI = torch.ops.aten.silu_backward(g_hw_SI.mul_(up_SI), gate_SI)
        del g_hw_SI
        g_gu_S2I = torch.cat([g_gate_SI, g_up_SI], -1)
        del g_gate_SI, g_up_SI
        g_x = g_gate_up = None
        if ctx.needs_input_grad[0]:
            g_x = grouped_mm(g_gu_S2I, w_gate_up_ED2I.transpose(-2, -1), offs=offs_E)
            if outside_S1 is not None:
                g_x.masked_fill_(outside_S1, 0.0)
        if ctx.needs_input_grad[2]:
            g_gate_up = grouped_mm(x_SD.t(), g_gu_S2I, offs=offs_E)  # [E, D, 2I]
        return g_x, None, g_gate_up, g_down, g_rw, None


def grouped_swiglu_reference(x_SD: torch.Tensor, sizes: list[int], w_gate_up_ED2I: torch.Tensor,
                             w_down_EID: torch.Tensor, rw_S: torch.Tensor | None = None) -> torch.Tensor:
    """Plain autograd, one expert at a time: expert e takes the next ``sizes[e]`` rows; the rows after
    the last segment (``x_SD.shape[0] - sum(sizes)``) come out zero. Also the path where torch has no
    grouped GEMM for the device / dtype."""
    tail = x_SD.shape[0] - sum(sizes)
    rws = [None] * (len(sizes) + 1) if rw_S is None else torch.split(rw_S[:, None], [*sizes, tail])
    # unbind, not w[e]: the backward of indexing allocates a zero [E, ...] gradient per expert,
    # unbind's is one stack (3x faster CPU training steps, identical results)
    outs = []
    for x_e, rw_e, w_gu, w_d in zip(torch.split(x_SD, [*sizes, tail]), rws, w_gate_up_ED2I.unbind(0),
                                    w_down_EID.unbind(0)):
        gate, up = (x_e @ w_gu).chunk(2, -1)
        h = F.silu(gate) * up
        outs.append((h if rw_e is None else h * rw_e) @ w_d)
    outs.append(x_SD.new_zeros(tail, w_down_EID.shape[-1]))
    return torch.cat(outs)
