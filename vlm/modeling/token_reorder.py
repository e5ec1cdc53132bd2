"""Token reordering of the sorted MoE dispatch, as three autograd functions with cheap backwards.

``gather_rows``: the N * K assignment rows in expert order, ``x_ND[token_S]``; its backward sums each
token's K rows back. ``permute_rows``: the routing weights in the same order, ``w[order_S]``; its backward
gathers back with the inverse permutation. ``scatter_sum``: expert outputs [S, D] summed back per token [N, D]; its
backward is the gather ``g_ND[token_S]``. Autograd's own backward of an index (a zero-filled
[S, D] buffer, then an accumulating ``index_put_``) and of the gather-then-sum combine cost an extra
[N * K, D] tensor each; the sums here are ``index_add_`` on CPU in fp32 (deterministic there, one pass, an
[N, D] output) and a gather + sum over K elsewhere (deterministic on CUDA, where ``index_add_`` uses
atomics; one rounding per sum in bf16). ``token_S = order_S // K``; ``inverse_NK`` (``inverse_order``) gives each assignment's row
in the sorted order. References: ``gather_rows_reference`` / ``scatter_sum_reference``
(tests/unit/modeling/test_token_reorder.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def inverse_order(order_S: torch.Tensor) -> torch.Tensor:
    """``inverse[order[i]] = i`` (order: a permutation of the N * K assignments)."""
    return torch.empty_like(order_S).scatter_(0, order_S, torch.arange(order_S.numel(), device=order_S.device))


def _sum_back(y_SD: torch.Tensor, token_S: torch.Tensor, inverse_NK: torch.Tensor, N: int) -> torch.Tensor:
    """out[n] = sum of the rows i of ``y_SD`` with token_S[i] == n; rows past y's end count zero."""
    S, D = y_SD.shape
    if y_SD.device.type == "cpu" and y_SD.dtype in (torch.float32, torch.float64):  # bf16 would round per add
        return y_SD.new_zeros(N, D).index_add_(0, token_S[:S], y_SD)
    K = inverse_NK.numel() // max(N, 1)
    if S < N * K:
        y_SD = F.pad(y_SD, (0, 0, 0, N * K - S))
    return y_SD[inverse_NK].view(N, K, D).sum(1)


class GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, token_S, inverse_NK):
        ctx.save_for_backward(token_S, inverse_NK)
        ctx.N = x_ND.shape[0]
        return x_ND.index_select(0, token_S)

    @staticmethod
    def backward(ctx, g_SD):
        token_S, inverse_NK = ctx.saved_tensors
        return _sum_back(g_SD.contiguous(), token_S, inverse_NK, ctx.N), None, None


class PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_N, order_S, inverse_N):
        ctx.save_for_backward(inverse_N)
        return x_N.index_select(0, order_S)

    @staticmethod
    def backward(ctx, g_S):
        (inverse_N,) = ctx.saved_tensors
        return g_S.index_select(0, inverse_N), None, None


class ScatterSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_SD, token_S, inverse_NK, N: int):
        ctx.save_for_backward(token_S[:y_SD.shape[0]])
        return _sum_back(y_SD, token_S, inverse_NK, N)

    @staticmethod
    def backward(ctx, g_ND):
        (token_S,) = ctx.saved_tensors
        return g_ND.index_select(0, token_S), None, None, None


def gather_rows(x_ND: torch.Tensor, token_S: torch.Tensor, inverse_NK: torch.Tensor) -> torch.Tensor:
    """``x_ND[token_S]`` [N * K, D]."""
    return GatherRows.apply(x_ND, token_S, inverse_NK)


def permute_rows(x_N: torch.Tensor, order_S: torch.Tensor, inverse_N: torch.Tensor) -> torch.Tensor:
    """``x_N[order_S]`` for a permutation ``order_S`` (``inverse_N = inverse_order(order_S)``): its
    backward is the inverse gather (one op; autograd's is a zero buffer and an ``index_put``)."""
    return PermuteRows.apply(x_N, order_S, inverse_N)


def scatter_sum(y_SD: torch.Tensor, token_S: torch.Tensor, inverse_NK: torch.Tensor, N: int) -> torch.Tensor:
    """[N, D]: row n sums the rows i < S of ``y_SD`` with ``token_S[i] == n`` (S <= N * K)."""
    return ScatterSum.apply(y_SD, token_S, inverse_NK, N)


def gather_rows_reference(x_ND, token_S, inverse_NK):
    return x_ND[token_S]


def scatter_sum_reference(y_SD, token_S, inverse_NK, N):
    S, D = y_SD.shape
    return y_SD.new_zeros(N, D).index_put((token_S[:S],), y_SD, accumulate=True)
