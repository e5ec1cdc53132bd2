"""Chunk module: cosine boundary router, boundary noise, the ratio loss, and concept formation.

Boundary router (paper section 3): ``p_n = 0.5 * (1 - cos(W_q h_n, W_k h_{n-1}))``, computed in
fp32 by ``boundary_prob`` on both the full-forward and the cached-decoding path. A boundary marks
the FIRST token of a chunk (H-Net convention). Forced boundaries (p = 1): the first real token of
every sequence / packed segment, and with ``modality_policy="split_at_switch"`` every text<->image
switch. Training samples ``b ~ Bernoulli(sharpen(p, tau))``; evaluation uses ``b = p >= 0.5``.
``boundary_mode="fixed"`` puts a boundary every round(R) tokens; ``"all"`` makes every token a
concept (R = 1, used to check a freshly converted model).

Which concept a token reads (causality; see also dechunk.py):
- ``concept_merge="last"``: the concept of chunk m is the encoder output of its boundary token,
  i.e. of the last token seen when the concept is created. Token n reads the concept of its own
  chunk, whose boundary token is at or before n: causal.
- ``concept_merge="sum"``: the concept is the sum of the chunk's tokens, only known once the chunk
  is complete, i.e. once the NEXT boundary fires. Token n in chunk m therefore reads chunk m - 1
  (the latest completed chunk; nothing for the first chunk of a sequence): all its tokens lie
  before n, and the boundary that completed it is at or before n: causal.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from vlm.config import ChunkingConfig

IMAGE, TEXT = 1, 0  # modality ids


def boundary_prob(q_BTD: torch.Tensor, k_prev_BTD: torch.Tensor) -> torch.Tensor:
    """p = 0.5 * (1 - cos(q_n, k_{n-1})) in fp32, clamped to [0, 1]."""
    cos = F.cosine_similarity(q_BTD.float(), k_prev_BTD.float(), dim=-1, eps=1e-8)
    return (0.5 * (1.0 - cos)).clamp(0.0, 1.0)


def sharpen(p: torch.Tensor, tau: float) -> torch.Tensor:
    """p^(1/tau) above 0.5, 1 - (1-p)^(1/tau) below: pushes p away from 0.5 before sampling."""
    return torch.where(p >= 0.5, p.pow(1.0 / tau), 1.0 - (1.0 - p).pow(1.0 / tau))


def ratio_loss(p_BT: torch.Tensor, b_BT: torch.Tensor, valid_BT: torch.Tensor, R: float) -> torch.Tensor:
    """L_aux = R/(R-1) * ((R-1) F G + (1-F)(1-G)), pooled over the real tokens of the micro-batch.

    G = mean p (un-sharpened, carries the gradient), F = mean b (the sampled boundaries). It is 1
    at F = G = 1/R and pulls both towards 1/R.
    """
    n = valid_BT.sum()
    if R <= 1.0 or n == 0:
        return p_BT.sum() * 0.0
    G = (p_BT * valid_BT).sum() / n
    F_ = (b_BT.float() * valid_BT).sum().detach() / n
    return R / (R - 1.0) * ((R - 1.0) * F_ * G + (1.0 - F_) * (1.0 - G))


def forced_boundaries(valid_BT, segment_BT, modality_BT, split_at_switch: bool) -> torch.Tensor:
    """First real token of each row / segment, plus modality switches when asked."""
    prev_valid = F.pad(valid_BT[:, :-1], (1, 0), value=False)
    forced = valid_BT & ~prev_valid
    if segment_BT is not None:
        forced |= valid_BT & (segment_BT != F.pad(segment_BT[:, :-1], (1, 0), value=-1))
    if split_at_switch and modality_BT is not None:
        forced |= valid_BT & prev_valid & (modality_BT != F.pad(modality_BT[:, :-1], (1, 0), value=-1))
    return forced


@dataclass
class Concepts:
    """The concept sequence of a batch: right-padded to the longest row."""
    x_BMD: torch.Tensor
    valid_BM: torch.Tensor
    position_BM: torch.Tensor  # 0, 1, ... restarting in each packed segment
    segment_BM: torch.Tensor | None
    prob_BM: torch.Tensor  # p of each chunk's boundary token (the EMA weight)
    index_BT: torch.Tensor  # chunk index of every token (-1 = padding)
    count_B: torch.Tensor  # concepts per row


class ChunkModule(nn.Module):
    def __init__(self, hidden: int, cfg: ChunkingConfig):
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.reset_router()

    def reset_router(self) -> None:
        if self.cfg.router_init == "identity":
            nn.init.eye_(self.q_proj.weight)
            nn.init.eye_(self.k_proj.weight)
        else:
            for lin in (self.q_proj, self.k_proj):
                nn.init.normal_(lin.weight, std=lin.in_features ** -0.5)

    # boundaries ---------------------------------------------------------------------------------
    def query_key(self, h_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q = W_q h, k = W_k h in fp32 (the same call on the full and the cached path)."""
        h32 = h_BTD.float()
        return F.linear(h32, self.q_proj.weight.float()), F.linear(h32, self.k_proj.weight.float())

    def probs(self, h_BTD: torch.Tensor) -> torch.Tensor:
        """Router probabilities of a whole sequence (position 0 is overwritten by forcing)."""
        q, k = self.query_key(h_BTD)
        return boundary_prob(q, F.pad(k[:, :-1], (0, 0, 1, 0)))

    def decide(self, p_BT, forced_BT, valid_BT, position_BT) -> tuple[torch.Tensor, torch.Tensor]:
        """Hard boundaries b and the probabilities p actually used (forced -> 1, padding -> 0)."""
        mode = self.cfg.boundary_mode
        if mode == "dynamic":
            tau = self.cfg.boundary_noise_tau
            if self.training and tau:
                b = torch.bernoulli(sharpen(p_BT.detach(), tau)).bool()
            else:
                b = p_BT >= 0.5
        elif mode == "fixed":
            every = max(1, int(round(self.cfg.target_ratio)))
            b = (position_BT % every) == 0
            p_BT = b.float()
        else:  # "all"
            b = torch.ones_like(valid_BT)
            p_BT = torch.ones_like(p_BT)
        b = (b | forced_BT) & valid_BT
        p_BT = torch.where(forced_BT, torch.ones_like(p_BT), p_BT) * valid_BT
        return b, p_BT

    def aux_loss(self, p_BT, b_BT, valid_BT, modality_BT) -> torch.Tensor:
        cfg = self.cfg
        if cfg.boundary_mode != "dynamic":
            return p_BT.sum() * 0.0
        if cfg.image_target_ratio is None or modality_BT is None:
            return ratio_loss(p_BT, b_BT, valid_BT, cfg.target_ratio)
        loss, total = p_BT.sum() * 0.0, valid_BT.sum().clamp(min=1)
        for mod, R in ((IMAGE, cfg.image_target_ratio), (TEXT, cfg.text_target_ratio)):
            sel = valid_BT & (modality_BT == mod)
            loss = loss + ratio_loss(p_BT, b_BT, sel, R) * sel.sum() / total
        return loss

    # concepts -----------------------------------------------------------------------------------
    def form_concepts(self, h_BTD, b_BT, p_BT, valid_BT, segment_BT) -> Concepts:
        B, T, D = h_BTD.shape
        index_BT = torch.where(valid_BT, b_BT.long().cumsum(1) - 1, torch.full_like(b_BT, -1, dtype=torch.long))
        count_B = b_BT.sum(1)
        M = max(int(count_B.max()), 1)
        rows_BT = torch.arange(B, device=h_BTD.device)[:, None].expand(B, T)
        x_BMD = h_BTD.new_zeros(B, M, D)
        if self.cfg.concept_merge == "last":
            x_BMD = x_BMD.index_put((rows_BT[b_BT], index_BT[b_BT]), h_BTD[b_BT])
        else:
            tok = valid_BT & (index_BT >= 0)
            x_BMD = x_BMD.index_put((rows_BT[tok], index_BT[tok]), h_BTD[tok], accumulate=True)
        valid_BM = torch.arange(M, device=h_BTD.device)[None] < count_B[:, None]
        prob_BM = p_BT.new_zeros(B, M).index_put((rows_BT[b_BT], index_BT[b_BT]), p_BT[b_BT])
        segment_BM = None
        arange_M = torch.arange(M, device=h_BTD.device)[None].expand(B, M)
        position_BM = arange_M
        if segment_BT is not None:
            segment_BM = segment_BT.new_zeros(B, M).index_put((rows_BT[b_BT], index_BT[b_BT]), segment_BT[b_BT])
            starts = segment_BM != F.pad(segment_BM[:, :-1], (1, 0), value=-1)
            first = torch.where(starts, arange_M, torch.zeros_like(arange_M)).cummax(1).values
            position_BM = arange_M - first
        return Concepts(x_BMD, valid_BM, position_BM, segment_BM, prob_BM, index_BT, count_B)
