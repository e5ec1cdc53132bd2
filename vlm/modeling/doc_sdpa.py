"""The CPU ``loop`` kernel of varlen.py as one autograd Function: causal attention per document
with torch's CPU flash kernel (the one ``F.scaled_dot_product_attention`` runs on the CPU), the
documents' outputs and gradients joined by one ``cat`` per tensor.

Against SDPA per document view + ``cat`` under autograd: no zero-filled full-size gradient per
document (a slice's backward). The output is token-major [B, T, H, D], so the caller's reshape to
[B, T, H * D] is a view; the input gradients come back in the same token-major memory layout
(viewed as [B, H, T, D]), the layout of the projections the heads were split from. Per document
and layer: one kernel forward, one backward (GQA in the kernel: keys / values are not repeated per
query group). Reference: the dense mask (tests/unit/modeling/test_varlen_attention.py, forward and
backward).
"""
from __future__ import annotations

import torch

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _spans(pieces, T: int):
    """(is a run of length-1 documents, row slice, position slice) of every piece."""
    for a, n, single in pieces:
        b, t = divmod(a, T)
        yield single, slice(b, b + 1), slice(t, t + n)


def _tokens(x_1hnD: torch.Tensor) -> torch.Tensor:
    """[1, h, n, D] -> [n, h, D] (a view)."""
    return x_1hnD[0].transpose(0, 1)


def _join(parts: list, B: int, T: int) -> torch.Tensor:
    """[n_i, h, D] pieces in flat token order -> [B, h, T, D] over token-major memory (one cat)."""
    flat_NhD = torch.cat(parts)  # a new tensor also for one piece (never a view of an input)
    _, h, D = flat_NhD.shape
    return flat_NhD.view(B, T, h, D).transpose(1, 2)


class DocSDPA(torch.autograd.Function):
    """``apply(q_BHTD, k_BHTD, v_BHTD, pieces, T)`` -> out [B, T, H, D] (contiguous).

    ``pieces``: (flat start, length, is a run of length-1 documents) in flat row-major order,
    tiling all B * T positions, none crossing a row (``DocLayout.pieces``). A length-1 document's
    softmax is over one key: its output is its value (its query's group), and q / k get a zero
    gradient there."""

    @staticmethod
    def forward(ctx, q_BHTD, k_BHTD, v_BHTD, pieces, T):
        B, H, _, D = q_BHTD.shape
        group = H // k_BHTD.shape[1]
        outs, lses = [], []
        for single, rows, span in _spans(pieces, T):
            v = v_BHTD[rows, :, span]
            if single:
                outs.append(_tokens(v.repeat_interleave(group, dim=1) if group > 1 else v))
                lses.append(None)
                continue
            o, lse = _FWD(q_BHTD[rows, :, span], k_BHTD[rows, :, span], v, 0.0, True)
            outs.append(_tokens(o))
            lses.append(lse)
        out_BTHD = _join(outs, B, T).transpose(1, 2)
        ctx.save_for_backward(q_BHTD, k_BHTD, v_BHTD, out_BTHD, *(x for x in lses if x is not None))
        ctx.pieces, ctx.T, ctx.group = pieces, T, group
        ctx.has_lse = [x is not None for x in lses]
        return out_BTHD

    @staticmethod
    def backward(ctx, g_BTHD):
        q_BHTD, k_BHTD, v_BHTD, out_BTHD, *lses = ctx.saved_tensors
        T, group = ctx.T, ctx.group
        B, H, _, D = q_BHTD.shape
        lse_iter = iter(lses)
        dqs, dks, dvs = [], [], []
        zeros = None
        for (single, rows, span), has_lse in zip(_spans(ctx.pieces, T), ctx.has_lse):
            g = g_BTHD[rows, span].transpose(1, 2)
            if single:
                n = span.stop - span.start
                if zeros is None:  # one zero buffer for every run: q / k get no gradient there
                    zeros = q_BHTD.new_zeros(T, H, D)
                dqs.append(zeros[:n])
                dks.append(zeros[:n, :k_BHTD.shape[1]])
                g_nHD = _tokens(g)
                dvs.append(g_nHD if group == 1 else g_nHD.reshape(n, H // group, group, D).sum(2))
                continue
            dq_, dk_, dv_ = _BWD(g, q_BHTD[rows, :, span], k_BHTD[rows, :, span], v_BHTD[rows, :, span],
                                 out_BTHD[rows, span].transpose(1, 2), next(lse_iter), 0.0, True)
            dqs.append(_tokens(dq_))
            dks.append(_tokens(dk_))
            dvs.append(_tokens(dv_))
        return _join(dqs, B, T), _join(dks, B, T), _join(dvs, B, T), None, None
