"""Triton kernel of ``linear_scan.scan``: y_m = a_m y_{m-1} + x_m over M, three launches whatever M.

Reduce, carry, scan (the chunked scan of Mamba-2's SSD with one state per channel, the same
closed form as ``linear_scan.scan_torch``): the sequence is cut into chunks of Q; (1) each (row,
chunk, channel tile) multiplies its chunk by the [Q, Q] decay matrix (one fp32 ``tl.dot``: the scan
from a zero state) and writes the chunk's end state and total log decay; (2) each (row, channel
tile) carries the states across the chunks, CB chunks at a time with the same matrix; (3) each chunk
adds its true start state times the decay from the chunk start and writes y. Decay matrices come
from masked cumulative sums of log a (no difference of large sums, no division by a cumulative
product): a = 0 (p = 1) resets exactly and an underflow only ever rounds a vanishing term to 0.
``reverse`` runs the backward recurrence y_m = a_{m+1} y_{m+1} + x_m without flipping anything.
Tested on CPU under ``TRITON_INTERPRET=1`` against the loop, and compiled for sm_90 without a GPU
(tests/unit/modeling/test_linear_scan.py).
"""
from __future__ import annotations

import torch

try:  # (transformers' remote-code import check skips a try block: this file loads only where triton imports)
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover
    raise ImportError("vlm.modeling.linear_scan_triton needs triton (linear_scan picks it only when it imports)") from e

Q = 64  # concepts per chunk
CB = 64  # chunks carried per step of kernel (2)

TINY = tl.constexpr(1.1754943508222875e-38)  # log(0) -> about -87: exp underflows to exactly 0, no -inf


@triton.jit
def _decay_matrix(log_a, Q: tl.constexpr):
    """W[i, j] = prod_{j < l <= i} a_l for j <= i, else 0, from log a [Q] (a masked cumulative sum)."""
    r = tl.arange(0, Q)
    W = tl.exp(tl.cumsum(tl.where(r[None, :] < r[:, None], log_a[:, None], 0.0), 0))
    return tl.where(r[None, :] <= r[:, None], W, 0.0)


@triton.jit
def _chunk(a_ptr, x_ptr, b, c, dt, L, D, Q: tl.constexpr, BD: tl.constexpr, REVERSE: tl.constexpr):
    """Chunk c of row b, channel tile dt, from a zero state: (log decay from the chunk start, y, offsets)."""
    j = c * Q + tl.arange(0, Q)  # position in scan order
    d = dt * BD + tl.arange(0, BD)
    live = j < L
    if REVERSE:
        pos = L - 1 - j
        apos = pos + 1  # the backward step at m uses a_{m+1}
    else:
        pos = j
        apos = j
    a = tl.load(a_ptr + b * L + apos, mask=live & (apos < L), other=1.0)  # padding steps: identities
    log_a = tl.log(tl.maximum(a, TINY))
    offs = (b * L + pos[:, None]) * D + d[None, :]
    mask = live[:, None] & (d < D)[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    Y = tl.dot(_decay_matrix(log_a, Q), x, input_precision="ieee")
    return tl.cumsum(log_a, 0), Y, offs, mask, d


@triton.jit
def _last_row(Y, n: tl.constexpr):
    return tl.sum(tl.where(tl.arange(0, n)[:, None] == n - 1, Y, 0.0), 0)


@triton.jit
def _chunk_ends(a_ptr, x_ptr, end_ptr, dec_ptr, L, D, N,
                Q: tl.constexpr, BD: tl.constexpr, REVERSE: tl.constexpr):
    """end[b, c] = chunk c's state from a zero start; dec[b, c] = its total log decay."""
    c, dt, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    cum, Y, _offs, _mask, d = _chunk(a_ptr, x_ptr, b, c, dt, L, D, Q, BD, REVERSE)
    tl.store(end_ptr + (b * N + c) * D + d, _last_row(Y, Q), mask=d < D)
    if dt == 0:
        tl.store(dec_ptr + b * N + c, tl.sum(tl.where(tl.arange(0, Q) == Q - 1, cum, 0.0), 0))


@triton.jit
def _chunk_starts(end_ptr, dec_ptr, start_ptr, D, N, CB: tl.constexpr, BD: tl.constexpr):
    """start[b, c + 1] = the true state after chunk c (start[b, 0] = 0), CB chunks at a time."""
    dt, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    d = dt * BD + tl.arange(0, BD)
    dm = d < D
    s = tl.zeros([BD], dtype=tl.float32)
    tl.store(start_ptr + b * (N + 1) * D + d, s, mask=dm)
    for c0 in range(0, N, CB):
        cc = c0 + tl.arange(0, CB)
        cm = cc < N
        dec = tl.load(dec_ptr + b * N + cc, mask=cm, other=0.0)
        mask = cm[:, None] & dm[None, :]
        e = tl.load(end_ptr + (b * N + cc[:, None]) * D + d[None, :], mask=mask, other=0.0)
        S = tl.dot(_decay_matrix(dec, CB), e, input_precision="ieee")
        S += tl.exp(tl.cumsum(dec, 0))[:, None] * s[None, :]
        tl.store(start_ptr + (b * (N + 1) + cc[:, None] + 1) * D + d[None, :], S, mask=mask)
        s = _last_row(S, CB)


@triton.jit
def _chunk_out(a_ptr, x_ptr, start_ptr, y_ptr, L, D, N,
               Q: tl.constexpr, BD: tl.constexpr, REVERSE: tl.constexpr):
    c, dt, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    cum, Y, offs, mask, d = _chunk(a_ptr, x_ptr, b, c, dt, L, D, Q, BD, REVERSE)
    s = tl.load(start_ptr + (b * (N + 1) + c) * D + d, mask=d < D, other=0.0)
    tl.store(y_ptr + offs, Y + tl.exp(cum)[:, None] * s[None, :], mask=mask)


def scan(a_BM: torch.Tensor, x_BMD: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """fp32 y [B, M, D]: y_m = a_m y_{m-1} + x_m, or with ``reverse`` y_m = a_{m+1} y_{m+1} + x_m."""
    a = a_BM.float().contiguous()
    x = x_BMD.float().contiguous()
    B, L, D = x.shape
    N = triton.cdiv(L, Q)
    BD = max(16, min(64, triton.next_power_of_2(D)))  # tl.dot wants >= 16
    ends = x.new_empty(B, N, D)
    decays = x.new_empty(B, N)
    starts = x.new_empty(B, N + 1, D)
    y = torch.empty_like(x)
    tiles = triton.cdiv(D, BD)
    _chunk_ends[(N, tiles, B)](a, x, ends, decays, L, D, N, Q=Q, BD=BD, REVERSE=reverse)
    _chunk_starts[(tiles, B)](ends, decays, starts, D, N, CB=CB, BD=BD)
    _chunk_out[(N, tiles, B)](a, x, starts, y, L, D, N, Q=Q, BD=BD, REVERSE=reverse)
    return y
