"""The language-model loss: next-token cross entropy with labels aligned to the inputs (``shift_labels``),
on full logits (``lm_loss_fn``, the reference) or chunk by chunk through the LM head without holding the
[tokens, vocab] logits (``chunked_lm_loss``; liger's fused linear cross entropy where
``train.fused_kernels.cross_entropy`` chose it).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from .cross_entropy import cross_entropy_sum
from .fused_kernels import ACTIVE as KERNELS_ACTIVE, IMPL as KERNELS


def shift_labels(labels_BT: torch.Tensor) -> torch.Tensor:
    """Labels moved one step left (position t is scored against the label of t + 1), the last
    position -100: the logits / hidden states are then used whole, never sliced (a slice of [T, V]
    logits costs a zero-filled gradient of the full size and a copy in the backward)."""
    return F.pad(labels_BT[:, 1:], (0, 1), value=-100)


def lm_loss_fn(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy on full fp32 logits (the reference of ``chunked_lm_loss``); labels are
    aligned with inputs (shifted here, ``shift_labels``), -100 ignored; 0 when no label is left. No host read."""
    labels_N = shift_labels(labels_BT).reshape(-1)
    total = cross_entropy_sum(logits_BTV.reshape(-1, logits_BTV.shape[-1]), labels_N)
    return total / (labels_N != -100).sum().clamp(min=1)


CE_CHUNK_BYTES = 256 * 2 ** 20  # fp32 logits of one chunk of ``chunked_lm_loss``


def _chunk_ce_sum(head: nn.Module, h_ND: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    return cross_entropy_sum(head(h_ND), labels_N)


def chunked_lm_loss(head: nn.Module, hidden_BTD: torch.Tensor, labels_BT: torch.Tensor,
                    chunk_tokens: int | None = None) -> torch.Tensor:
    """``lm_loss_fn(head(hidden_BTD), labels_BT)`` without the full logits: every position (labels
    shifted, ``shift_labels``) runs through ``head`` + fp32 cross entropy ``chunk_tokens`` at a time,
    each chunk checkpointed (the backward recomputes its logits), so at most one chunk's logits
    [chunk, V] are alive. Sum of the chunk sums / number of label tokens, as the reference. No host read."""
    h_ND = hidden_BTD.reshape(-1, hidden_BTD.shape[-1])
    labels_N = shift_labels(labels_BT).reshape(-1)
    if KERNELS_ACTIVE["cross_entropy"] != "torch":  # liger's fused linear CE (train.fused_kernels)
        return KERNELS["cross_entropy"](h_ND, head.weight, labels_N) / (labels_N != -100).sum().clamp(min=1)
    chunk = chunk_tokens or max(1, CE_CHUNK_BYTES // (4 * head.out_features))
    total = h_ND.new_zeros((), dtype=torch.float32)
    # split, not slices: one gradient assembled for all chunks (each slice's would be zero-filled full size)
    for h_cD, labels_c in zip(h_ND.split(chunk), labels_N.split(chunk)):
        part = (head, h_cD, labels_c)
        if torch.is_grad_enabled():
            total = total + torch.utils.checkpoint.checkpoint(_chunk_ce_sum, *part, use_reentrant=False)
        else:
            total = total + _chunk_ce_sum(*part)
    return total / (labels_N != -100).sum().clamp(min=1)
