"""Summed cross entropy as one autograd function: it keeps the logits (which the caller holds anyway)
and one log-sum-exp per row, and its backward writes the [N, V] gradient once, in place.

``F.cross_entropy`` keeps the fp32 log-softmax [N, V] for its backward and allocates two more [N, V]
tensors there (a zero-filled NLL gradient and the log-softmax gradient); at a 16K vocabulary and
2K tokens each is 128 MiB of fresh memory, which on CPU is also page faults. Here rows go in chunks
of about ``CHUNK_ELEMS`` elements, so temporaries stay small; logits of any float dtype, the math in
fp32. The plain reference is ``cross_entropy_sum_reference`` (tests/unit/modeling/test_cross_entropy.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# elements per row chunk: on CPU a chunk that stays in cache (2K x 16K logits on 2 cores: 104 ms
# forward + backward, 2 ** 22: 115 ms); on a GPU few large chunks (each one a few kernel launches)
CHUNK_ELEMS = 2 ** 20
CHUNK_ELEMS_GPU = 2 ** 26


def _rows(logits_NV: torch.Tensor) -> int:
    elems = CHUNK_ELEMS if logits_NV.device.type == "cpu" else CHUNK_ELEMS_GPU
    return max(1, elems // max(logits_NV.shape[1], 1))


class CrossEntropySum(torch.autograd.Function):
    """``sum_n [label_n != ignore] (logsumexp(logits_n) - logits_n[label_n])``, fp32."""

    @staticmethod
    def forward(ctx, logits_NV, labels_N, ignore_index: int):
        N = logits_NV.shape[0]
        lse_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
        step = _rows(logits_NV)
        for s in range(0, N, step):
            torch.logsumexp(logits_NV[s:s + step].float(), -1, out=lse_N[s:s + step])
        valid_N = labels_N != ignore_index
        safe_N = torch.where(valid_N, labels_N, 0)
        target_N = logits_NV.gather(1, safe_N[:, None]).squeeze(1).float()
        ctx.save_for_backward(logits_NV, lse_N, safe_N, valid_N)
        return torch.where(valid_N, lse_N - target_N, 0.0).sum()

    @staticmethod
    def backward(ctx, g):
        logits_NV, lse_N, safe_N, valid_N = ctx.saved_tensors
        N = logits_NV.shape[0]
        scale_N1 = torch.where(valid_N, g.float(), 0.0)[:, None]  # d loss / d logit = scale * (softmax - onehot)
        grad_NV = torch.empty_like(logits_NV)
        step, fp32 = _rows(logits_NV), logits_NV.dtype == torch.float32
        for s in range(0, N, step):
            sl = slice(s, s + step)
            if fp32:  # the softmax written straight into the gradient
                g_cV = torch.ops.aten._softmax.out(logits_NV[sl], -1, False, out=grad_NV[sl]).mul_(scale_N1[sl])
            else:  # fp32 math, one rounding to the logits' dtype (after the one-hot term)
                g_cV = (logits_NV[sl].float() - lse_N[sl, None]).exp_().mul_(scale_N1[sl])
            g_cV.scatter_add_(1, safe_N[sl, None], -scale_N1[sl])
            if not fp32:
                grad_NV[sl] = g_cV
        return grad_NV, None, None


def cross_entropy_sum(logits_NV: torch.Tensor, labels_N: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Summed fp32 cross entropy over the rows whose label is not ``ignore_index`` (0 when none)."""
    return CrossEntropySum.apply(logits_NV, labels_N, ignore_index)


def cross_entropy_sum_reference(logits_NV: torch.Tensor, labels_N: torch.Tensor, ignore_index: int = -100):
    return F.cross_entropy(logits_NV.float(), labels_N, ignore_index=ignore_index, reduction="sum")
