"""DeChunk: EMA smoothing over concepts, the straight-through factor, and back to tokens.

    c_ema_m = p_m * c_hat_m + (1 - p_m) * c_ema_{m-1}      (p_m: p of chunk m's boundary token)
    z_n     = h_hat_n + STE(s_n) * c_ema_{read(n)},  s_n = p_n if b_n else 1 - p_n

``read(n)``: the token's own chunk for "last", the previous (completed) chunk of the same segment
for "sum" (chunking.py). ``c_hat`` is the concept model's update (output minus input), so the
identity residual is not counted twice and R = 1 (``boundary_mode="all"``) equals the plain MoE.
``ema_step`` is the recurrence (the plain loop ``ema_reference`` and cached decoding use it);
``ema_scan`` is the same recurrence as one scan (linear_scan.py), equal within 1e-5 in fp32; a packed
document restarts the EMA because its first concept has p = 1.
"""
from __future__ import annotations

import torch

from .linear_scan import BLOCK, linear_scan


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


def ema_scan(c_BMD: torch.Tensor, p_BM: torch.Tensor, block: int = BLOCK, impl: str = "auto") -> torch.Tensor:
    """The EMA as one linear scan y_m = (1 - p_m) y_{m-1} + p_m c_m (linear_scan.py: a number of ops
    independent of M; Triton on CUDA, the torch chunked scan elsewhere), in fp32, cast back."""
    p = p_BM.float()
    return linear_scan(1.0 - p, p[..., None] * c_BMD.float(), impl=impl, block=block).to(c_BMD.dtype)


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
            concept_segment_BM=None, segment_BT=None, scan: bool = True, scan_impl: str = "auto"):
    """Returns z (the decoder input) and the per-token concept signal (for joint decoding). ``scan_impl``:
    the EMA scan's implementation (torch | triton | auto; ``runtime.scan_impl`` resolves the model's)."""
    ema_BMD = ema_scan(c_hat_BMD, concept_prob_BM, impl=scan_impl) if scan else ema_reference(c_hat_BMD, concept_prob_BM)
    idx_BT, ok_BT = read_index(index_BT, concept_segment_BM, segment_BT, merge)
    read_BTD = ema_BMD.gather(1, idx_BT[..., None].expand(-1, -1, ema_BMD.shape[-1]))
    read_BTD = read_BTD * ok_BT[..., None].to(read_BTD.dtype)
    s_BT = torch.where(b_BT, p_BT, 1.0 - p_BT)
    z_BTD = h_BTD + ste(s_BT)[..., None].to(h_BTD.dtype) * read_BTD
    return z_BTD, read_BTD
