"""DeChunk: EMA smoothing over concepts, the straight-through factor, and back to tokens.

    c_ema_m = p_m * c_hat_m + (1 - p_m) * c_ema_{m-1}      (p_m: p of chunk m's boundary token)
    z_n     = h_hat_n + STE(s_n) * c_ema_{read(n)},  s_n = p_n if b_n else 1 - p_n

``read(n)``: the token's own chunk for "last", the previous (completed) chunk of the same segment
for "sum" (chunking.py). ``c_hat`` is the concept model's update (output minus input), so the
identity residual is not counted twice and R = 1 (``boundary_mode="all"``) equals the plain MoE.
``ema_step`` is the recurrence (the plain loop ``ema_reference`` and cached decoding use it);
``ema_scan`` is the fast blocked scan of the same recurrence, equal within 1e-5 in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def ste(s: torch.Tensor) -> torch.Tensor:
    """Exactly 1 in the forward pass; the gradient flows to ``s``."""
    return 1.0 + (s - s.detach())


def ema_step(prev_BD: torch.Tensor, c_hat_BD: torch.Tensor, p_B: torch.Tensor) -> torch.Tensor:
    """One step of the EMA: p * c_hat + (1 - p) * prev."""
    p = p_B[:, None].to(c_hat_BD.dtype)
    return p * c_hat_BD + (1 - p) * prev_BD


def ema_reference(c_BMD: torch.Tensor, p_BM: torch.Tensor) -> torch.Tensor:
    """The plain loop over concepts (reference for ``ema_scan``)."""
    out, prev = [], torch.zeros_like(c_BMD[:, 0])
    for m in range(c_BMD.shape[1]):
        prev = ema_step(prev, c_BMD[:, m], p_BM[:, m])
        out.append(prev)
    return torch.stack(out, 1)


def _segsum(log_a_BNQ: torch.Tensor) -> torch.Tensor:
    """S[..., i, j] = sum_{j < l <= i} log_a[l] for j <= i, -inf above the diagonal (stable)."""
    Q = log_a_BNQ.shape[-1]
    x = log_a_BNQ[..., :, None].expand(*log_a_BNQ.shape, Q)  # x[..., l, j] = log_a[l]
    strict = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril(-1)
    x = x.masked_fill(~strict, 0.0).cumsum(-2)
    return x.masked_fill(~torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril(), float("-inf"))


def ema_scan(c_BMD: torch.Tensor, p_BM: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Blocked parallel scan of y_m = (1 - p_m) y_{m-1} + p_m c_m."""
    B, M, D = c_BMD.shape
    p = p_BM.float()
    x_BMD = p[..., None] * c_BMD.float()
    Q = min(block, M)
    pad = (-M) % Q
    if pad:
        x_BMD = F.pad(x_BMD, (0, 0, 0, pad))
        p = F.pad(p, (0, pad), value=1.0)
    nb = x_BMD.shape[1] // Q
    # log(1 - p): the value is clamped away from log 0 (p = 1), the gradient is the unclamped one
    # (a plain clamp would give d/dp = 0 at p = 1, unlike the loop).
    a = 1.0 - p
    a = a + (a.clamp(min=1e-12) - a).detach()
    log_a = torch.log(a).view(B, nb, Q)
    L_BNQQ = torch.exp(_segsum(log_a))
    y = L_BNQQ @ x_BMD.view(B, nb, Q, D)  # within-block recurrence from a zero state
    decay_BNQ = torch.exp(log_a.cumsum(-1))  # from each block's start to position i
    # unbind, not y[:, k]: the backward of each y[:, k] would write a full-size zero gradient
    # (quadratic in the number of blocks); unbind's backward stacks the block gradients once.
    state, blocks = torch.zeros_like(y[:, 0, 0]), []
    for y_BQD, decay_BQ in zip(y.unbind(1), decay_BNQ.unbind(1)):
        y_k = y_BQD + decay_BQ[:, :, None] * state[:, None]
        blocks.append(y_k)
        state = y_k[:, -1]
    return torch.cat(blocks, 1)[:, :M].to(c_BMD.dtype)


def read_index(index_BT: torch.Tensor, concept_segment_BM, segment_BT, merge: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Concept index each token reads and whether it reads anything (causal rule of chunking.py)."""
    if merge == "last":
        return index_BT.clamp(min=0), index_BT >= 0
    idx = index_BT - 1
    ok = idx >= 0
    if concept_segment_BM is not None:
        seg_of_prev = concept_segment_BM.gather(1, idx.clamp(min=0))
        ok = ok & (seg_of_prev == segment_BT)
    return idx.clamp(min=0), ok


def dechunk(h_BTD, c_hat_BMD, concept_prob_BM, p_BT, b_BT, index_BT, merge: str,
            concept_segment_BM=None, segment_BT=None, scan: bool = True):
    """Returns z (the decoder input) and the per-token concept signal (for joint decoding)."""
    ema_BMD = (ema_scan if scan else ema_reference)(c_hat_BMD, concept_prob_BM)
    idx_BT, ok_BT = read_index(index_BT, concept_segment_BM, segment_BT, merge)
    read_BTD = ema_BMD.gather(1, idx_BT[..., None].expand(-1, -1, ema_BMD.shape[-1]))
    read_BTD = read_BTD * ok_BT[..., None].to(read_BTD.dtype)
    s_BT = torch.where(b_BT, p_BT, 1.0 - p_BT)
    z_BTD = h_BTD + ste(s_BT)[..., None].to(h_BTD.dtype) * read_BTD
    return z_BTD, read_BTD
