"""DeChunk: EMA smoothing over concepts, the straight-through factor, and back to tokens.

    c_ema_m = p_m * c_hat_m + (1 - p_m) * c_ema_{m-1}      (p_m: p of chunk m's boundary token)
    z_n     = h_hat_n + STE(s_n) * c_ema_{read(n)},  s_n = p_n if b_n else 1 - p_n

``read(n)`` is chosen by the concept merge (see chunking.py): the token's own chunk for "last",
the previous (completed) chunk of the same segment for "sum". ``c_hat`` is the concept model's
update (its output minus its input), so the identity residual ``h_hat`` is not counted twice and a
model whose every token is a concept (R = 1, ``boundary_mode="all"``) equals the plain MoE.

``ema_reference`` is the plain loop (tests); ``ema_scan`` is the fast blocked scan: inside blocks
of Q concepts a [Q, Q] decay matrix built from a stable masked-cumsum segment sum, across blocks
a short carry loop. Both agree within 1e-5 in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def ste(s: torch.Tensor) -> torch.Tensor:
    """Exactly 1 in the forward pass; the gradient flows to ``s``."""
    return 1.0 + (s - s.detach())


def ema_reference(c_BMD: torch.Tensor, p_BM: torch.Tensor) -> torch.Tensor:
    out, prev = [], torch.zeros_like(c_BMD[:, 0])
    for m in range(c_BMD.shape[1]):
        p = p_BM[:, m, None].to(c_BMD.dtype)
        prev = p * c_BMD[:, m] + (1 - p) * prev
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
    # log(1 - p) with the value clamped (p = 1 would give log 0) but the true gradient kept: a
    # plain clamp zeroed d/dp at p = 1 exactly, so the scan's gradient differed from the loop's.
    a = 1.0 - p
    a = a + (a.clamp(min=1e-12) - a).detach()
    log_a = torch.log(a).view(B, nb, Q)
    L_BNQQ = torch.exp(_segsum(log_a))
    y = L_BNQQ @ x_BMD.view(B, nb, Q, D)  # within-block recurrence from a zero state
    decay_BNQ = torch.exp(log_a.cumsum(-1))  # from each block's start to position i
    state, blocks = torch.zeros_like(y[:, 0, 0]), []
    for k in range(nb):
        y_k = y[:, k] + decay_BNQ[:, k, :, None] * state[:, None]
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
