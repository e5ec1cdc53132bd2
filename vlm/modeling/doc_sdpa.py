"""The CPU ``loop`` kernel of varlen.py as one autograd Function: causal attention per document
with torch's CPU flash kernel (the one ``F.scaled_dot_product_attention`` runs on the CPU), every
document's output written into one [B, T, H, D] buffer and its gradients into one buffer per input.

Against SDPA per document view + ``cat``: no zero-filled full-size gradient per document (a
slice's backward), no concatenated copy of the output, and the output is already token-major, so
the caller's reshape to [B, T, H * D] is a view. Reference: the dense mask
(tests/unit/modeling/test_varlen_attention.py, forward and backward).
GQA: a document's keys / values are repeated per query group (transient, one document at a time)
and their gradients summed back over the group.
"""
from __future__ import annotations

import torch

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _expand(x_BHnD: torch.Tensor, group: int) -> torch.Tensor:
    return x_BHnD.repeat_interleave(group, dim=1) if group > 1 else x_BHnD


def _group_sum(g_1HnD: torch.Tensor, group: int) -> torch.Tensor:  # [1, H, n, D] -> [1, H / group, n, D]
    if group == 1:
        return g_1HnD
    _, H, n, D = g_1HnD.shape
    return g_1HnD.reshape(1, H // group, group, n, D).sum(2)


def _spans(pieces, T: int):
    """(is a run of length-1 documents, row slice, position slice) of every piece."""
    for a, n, single in pieces:
        b, t = divmod(a, T)
        yield single, slice(b, b + 1), slice(t, t + n)


class DocSDPA(torch.autograd.Function):
    """``apply(q_BHTD, k_BHTD, v_BHTD, pieces, T)`` -> out [B, T, H, D] (contiguous).

    ``pieces``: (flat start, length, is a run of length-1 documents) in flat row-major order,
    tiling all B * T positions, none crossing a row (``DocLayout.pieces``). A length-1 document's
    softmax is over one key: its output is its value, and q / k get a zero gradient there."""

    @staticmethod
    def forward(ctx, q_BHTD, k_BHTD, v_BHTD, pieces, T):
        B, H, _, D = q_BHTD.shape
        group = H // k_BHTD.shape[1]
        out_BTHD = q_BHTD.new_empty(B, T, H, D)
        lse_BHT = q_BHTD.new_zeros(B, H, T, dtype=torch.float32)
        for single, rows, span in _spans(pieces, T):
            v = _expand(v_BHTD[rows, :, span], group)
            if single:
                out_BTHD[rows, span].copy_(v.transpose(1, 2))
                continue
            o, lse = _FWD(q_BHTD[rows, :, span], _expand(k_BHTD[rows, :, span], group), v, 0.0, True)
            out_BTHD[rows, span].copy_(o.transpose(1, 2))
            lse_BHT[rows, :, span].copy_(lse)
        ctx.save_for_backward(q_BHTD, k_BHTD, v_BHTD, out_BTHD, lse_BHT)
        ctx.pieces, ctx.T, ctx.group = pieces, T, group
        return out_BTHD

    @staticmethod
    def backward(ctx, g_BTHD):
        q_BHTD, k_BHTD, v_BHTD, out_BTHD, lse_BHT = ctx.saved_tensors
        T, group = ctx.T, ctx.group
        dq, dk, dv = torch.zeros_like(q_BHTD), torch.zeros_like(k_BHTD), torch.zeros_like(v_BHTD)
        for single, rows, span in _spans(ctx.pieces, T):
            g = g_BTHD[rows, span].transpose(1, 2)
            if single:
                dv[rows, :, span] = _group_sum(g, group)
                continue
            dq_, dk_, dv_ = _BWD(g, q_BHTD[rows, :, span], _expand(k_BHTD[rows, :, span], group),
                                 _expand(v_BHTD[rows, :, span], group), out_BTHD[rows, span].transpose(1, 2),
                                 lse_BHT[rows, :, span], 0.0, True)
            dq[rows, :, span] = dq_
            dk[rows, :, span] = _group_sum(dk_, group)
            dv[rows, :, span] = _group_sum(dv_, group)
        return dq, dk, dv, None, None
