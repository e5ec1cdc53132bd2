"""``expert_mlp.GroupedSwiGLU`` with the activation as two Triton kernels (``swiglu_triton.py``).

The same grouped GEMMs, saved tensors and zeroed rows outside every expert segment as
``GroupedSwiGLU``; what differs is the elementwise work between them: the forward's
``silu(gate) * up * rw`` is one kernel instead of three, and the backward's (recomputing ``h``,
``d rw``, ``d gate`` / ``d up`` written into one [S, 2I] tensor) one kernel instead of about ten
plus a cat. Picked by ``fused_kernels`` (``train.fused_kernels.swiglu``); compared with
``GroupedSwiGLU`` in tests/unit/modeling/test_fused_kernels.py.
"""
from __future__ import annotations

import torch

from .expert_mlp import _outside
from .grouped_mm import grouped_mm
from .swiglu_triton import swiglu_bwd, swiglu_fwd


class GroupedSwiGLUFused(torch.autograd.Function):
    """``GroupedSwiGLU``'s figures (same arguments)."""

    @staticmethod
    def forward(ctx, x_SD, offs_E, w_gate_up_ED2I, w_down_EID, rw_S, tail: bool = True):
        gu_S2I = grouped_mm(x_SD, w_gate_up_ED2I, offs=offs_E)
        h_SI = swiglu_fwd(gu_S2I, rw_S)
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
        g_hw_SI = grouped_mm(g_SD, w_down_EID.transpose(-2, -1), offs=offs_E)  # d loss / d (h * rw)
        hw_SI, g_gu_S2I, g_rw = swiglu_bwd(gu_S2I, g_hw_SI, rw_S)
        del g_hw_SI
        g_rw = g_rw if rw_S is not None and ctx.needs_input_grad[4] else None
        if g_rw is not None and outside_S1 is not None:
            g_rw.masked_fill_(outside_S1[:, 0], 0.0)
        g_down = grouped_mm(hw_SI.t(), g_SD, offs=offs_E) if ctx.needs_input_grad[3] else None  # [E, I, D]
        del hw_SI
        g_x = g_gate_up = None
        if ctx.needs_input_grad[0]:
            g_x = grouped_mm(g_gu_S2I, w_gate_up_ED2I.transpose(-2, -1), offs=offs_E)
            if outside_S1 is not None:
                g_x.masked_fill_(outside_S1, 0.0)
        if ctx.needs_input_grad[2]:
            g_gate_up = grouped_mm(x_SD.t(), g_gu_S2I, offs=offs_E)  # [E, D, 2I]
        return g_x, None, g_gate_up, g_down, g_rw, None
