"""Chunk module: cosine boundary router, forced boundaries, the ratio loss, concept formation, the
carry that continues a sequence in cached decoding, and the achieved-ratio helpers.

    p_n = 0.5 * (1 - cos(W_q h_n, W_k h_{n-1}))   (fp32)      b_n = 1[p_n >= 0.5] (eval)

A boundary marks the FIRST token of a chunk (H-Net). Which concept a token reads (causality):
- ``concept_merge="last"``: a chunk's concept is its boundary token's vector; token n reads its own
  chunk, whose boundary token is at or before n.
- ``concept_merge="sum"``: a chunk's concept is the sum of its tokens, known only once the NEXT
  boundary closes it; token n therefore reads the latest completed chunk (the previous one).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .dechunk import ema_scan, ema_step
from .syncs import host_sync

IMAGE, TEXT = 1, 0  # modality ids


def boundary_prob(q_BTD: torch.Tensor, k_prev_BTD: torch.Tensor) -> torch.Tensor:
    """p = 0.5 * (1 - cos(q_n, k_{n-1})) in fp32, clamped to [0, 1].

    No gradient where p is 0 or 1: cos = +-1 to fp32 precision is its extremum, and the gradient
    autograd would give there is rounding (the sine of an angle fp32 does not resolve, over |q|:
    large for a small q). Explicit, because clamp's backward at its bounds differs between torch
    versions (2.11 passes the gradient there, 2.14 does not)."""
    cos = F.cosine_similarity(q_BTD.float(), k_prev_BTD.float(), dim=-1, eps=1e-8)
    p_BT = 0.5 * (1.0 - cos)
    return torch.where((p_BT > 0.0) & (p_BT < 1.0), p_BT, p_BT.detach().clamp(0.0, 1.0))


def sharpen(p: torch.Tensor, tau: float) -> torch.Tensor:
    """p^(1/tau) above 0.5, 1 - (1-p)^(1/tau) below: pushes p away from 0.5 before sampling."""
    return torch.where(p >= 0.5, p.pow(1.0 / tau), 1.0 - (1.0 - p).pow(1.0 / tau))


def ratio_loss(p_BT: torch.Tensor, b_BT: torch.Tensor, valid_BT: torch.Tensor, R: float) -> torch.Tensor:
    """L_aux = R/(R-1) * ((R-1) F G + (1-F)(1-G)), pooled over the real tokens of the micro-batch.

    G = mean p (un-sharpened, carries the gradient), F = mean b (the sampled boundaries). It is 1
    at F = G = 1/R and pulls both towards 1/R.
    """
    if R <= 1.0:
        return p_BT.sum() * 0.0
    n = valid_BT.sum()
    G = (p_BT * valid_BT).sum() / n.clamp(min=1)
    F_ = (b_BT.float() * valid_BT).sum().detach() / n.clamp(min=1)
    loss = R / (R - 1.0) * ((R - 1.0) * F_ * G + (1.0 - F_) * (1.0 - G))
    return torch.where(n > 0, loss, 0.0)  # no real token: 0 (a where, not an if: no host sync)


def _delay(x_BT: torch.Tensor, first) -> torch.Tensor:
    """x one step later: column t holds x[:, t - 1]; column 0 gets ``first`` (a value or [B])."""
    first_B1 = first[:, None].to(x_BT.dtype) if torch.is_tensor(first) else torch.full_like(x_BT[:, :1], first)
    return torch.cat([first_B1, x_BT[:, :-1]], 1)


def forced_boundaries(valid_BT, segment_BT, modality_BT, split_at_switch: bool, carry=None) -> torch.Tensor:
    """Boundaries forced to p = 1: the first real token of each row and of each packed segment, and
    with ``split_at_switch`` every modality change between two real tokens.

    ``carry`` (a started ``ChunkCarry``) continues a sequence: the token before column 0 is its last
    token, which is real, of the same segment, with modality ``carry.prev_modality_B``.
    """
    cont = carry is not None and carry.started
    prev_valid = _delay(valid_BT, cont)
    forced = valid_BT & ~prev_valid
    if segment_BT is not None:
        forced |= valid_BT & (segment_BT != _delay(segment_BT, segment_BT[:, 0] if cont else -1))
    if split_at_switch and modality_BT is not None:
        prev_mod = carry.prev_modality_B if cont and carry.prev_modality_B is not None else -1
        forced |= valid_BT & prev_valid & (modality_BT != _delay(modality_BT, prev_mod))
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

    def completed_B(self, merge: str) -> torch.Tensor:
        """Concepts per row that tokens after this sequence can read: all for "last", all but the
        still-open last chunk for "sum" (what the concept caches keep)."""
        return (self.count_B - (1 if merge == "sum" else 0)).clamp(min=0)


@dataclass(kw_only=True)
class ChunkCarry:
    """Per-row chunk state between calls, so cached decoding continues a sequence exactly as the
    full forward would. Empty (all None) until a first call over a whole sequence (the prefill).

    prev_k_BD        router key W_k h of the last token (fp32): the next p needs k_{n-1}
    prev_modality_B  modality of the last token (None without modality ids): switch boundaries
    ema_BD           EMA of the latest completed concept, the one the next token reads
    has_ema_B        whether that concept exists
    run_sum_BD       "sum" only: running sum of the open chunk's tokens
    run_p_B          "sum" only: p of the open chunk's boundary token (its EMA weight once closed)

    Written by ``ChunkModule.boundaries`` (router fields), ``start`` (after the prefill's concept
    model) and ``merge`` / ``update_ema`` (one token at a time).
    """
    prev_k_BD: torch.Tensor | None = None
    prev_modality_B: torch.Tensor | None = None
    ema_BD: torch.Tensor | None = None
    has_ema_B: torch.Tensor | None = None
    run_sum_BD: torch.Tensor | None = None
    run_p_B: torch.Tensor | None = None

    @property
    def started(self) -> bool:
        return self.prev_k_BD is not None

    def start(self, con: Concepts, c_hat_BMD: torch.Tensor, merge: str, scan_impl: str = "auto") -> None:
        """After a whole sequence (the prefill): the EMA the next token reads and the open chunk."""
        rows = torch.arange(con.count_B.shape[0], device=con.count_B.device)
        done_B = con.completed_B(merge)
        ema_BMD = ema_scan(c_hat_BMD, con.prob_BM, impl=scan_impl)
        self.ema_BD = ema_BMD[rows, (done_B - 1).clamp(min=0)]
        self.has_ema_B = done_B > 0
        if merge == "sum":
            last = (con.count_B - 1).clamp(min=0)
            self.run_sum_BD, self.run_p_B = con.x_BMD[rows, last], con.prob_BM[rows, last]

    def merge(self, merge: str, h_BD, b_B, p_B) -> tuple[torch.Tensor, torch.Tensor]:
        """One token of ``form_concepts``: where ``b_B``, the concept that completes at this token and
        its EMA weight. "last": the boundary token itself, with its own p. "sum": the chunk this
        boundary closes (its running sum), with the p of THAT chunk's boundary token."""
        if merge == "last":
            return h_BD, p_B
        concept_BD, weight_B = self.run_sum_BD, self.run_p_B
        self.run_sum_BD = torch.where(b_B[:, None], h_BD, self.run_sum_BD + h_BD)
        self.run_p_B = torch.where(b_B, p_B, self.run_p_B)
        return concept_BD, weight_B

    def update_ema(self, c_hat_BD, weight_B, commit_B) -> None:
        """The EMA recurrence (``dechunk.ema_step``) for rows where a concept completed."""
        new_BD = ema_step(self.ema_BD, c_hat_BD, weight_B)
        self.ema_BD = torch.where(commit_B[:, None], new_BD, self.ema_BD)
        self.has_ema_B = self.has_ema_B | commit_B

    def read(self) -> torch.Tensor:
        """The concept signal the next token reads (zero before the first readable concept)."""
        return self.ema_BD * self.has_ema_B[:, None].to(self.ema_BD.dtype)


class ChunkModule(nn.Module):
    """Router + chunk rules. ``cfg`` is the model config object itself (a ``ChunkingConfig`` in unit
    tests), read at every call and never copied: the full forward, dechunk and cached decoding all
    see one config, so a setting changed after construction (e.g. ``boundary_mode``) applies to all."""

    def __init__(self, hidden: int, cfg):
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
        """q = W_q h, k = W_k h in fp32."""
        h32 = h_BTD.float()
        return F.linear(h32, self.q_proj.weight.float()), F.linear(h32, self.k_proj.weight.float())

    def probs(self, h_BTD: torch.Tensor, k_prev_BD: torch.Tensor | None = None) -> torch.Tensor:
        """Router probabilities; ``k_prev_BD`` is the key of the token before column 0 (decoding),
        else a zero key (p = 0.5 at position 0, which forcing overwrites)."""
        q, k = self.query_key(h_BTD)
        first = k_prev_BD[:, None] if k_prev_BD is not None else torch.zeros_like(k[:, :1])
        return boundary_prob(q, torch.cat([first, k[:, :-1]], 1))

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

    def boundaries(self, h_BTD, valid_BT, position_BT, segment_BT=None, modality_BT=None,
                   carry: ChunkCarry | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The boundary step of both paths: forced boundaries, router p, ``decide``. Returns b and the
        p used. Over a whole sequence ``carry`` is None or empty (then it is started); in cached
        decoding it holds the tokens before column 0. A given carry ends at the last column, which
        must be a real token (left padding)."""
        split = self.cfg.modality_policy == "split_at_switch"
        forced_BT = forced_boundaries(valid_BT, segment_BT, modality_BT, split, carry)
        k_prev = carry.prev_k_BD if carry is not None and carry.started else None
        p_BT = self.probs(h_BTD) if k_prev is None else self.probs(h_BTD, k_prev)
        b_BT, p_BT = self.decide(p_BT, forced_BT, valid_BT, position_BT)
        if carry is not None:
            carry.prev_k_BD = self.query_key(h_BTD[:, -1:])[1][:, 0]
            carry.prev_modality_B = modality_BT[:, -1] if modality_BT is not None else None
        return b_BT, p_BT

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
    def form_concepts(self, h_BTD, b_BT, p_BT, valid_BT, segment_BT, capacity: int | None = None,
                      length: int | None = None) -> Concepts:
        """The concept sequence, no boolean indexing. Concept m of a row starts at its (m+1)-th
        boundary, found by ``searchsorted`` on the running boundary count and read with ``gather``;
        "sum" adds the tokens into their slots (``index_put`` accumulate, non-member tokens add zeros).
        ``form_concepts_reference`` is the plain version.

        Its length M: None reads the longest row's count (one named host sync); ``capacity`` (a host
        int >= T) is used as M with no device read: a concept starts at a real token, so no row has
        more than T and none is dropped; slots past a row's count are padding (``valid_BM`` False,
        zeros, p = 0). A tighter capacity would need an exact overflow path (docs/model.md). ``length``:
        M itself, read by the caller (the longest row's count, at least 1), no read here."""
        B, T, D = h_BTD.shape
        cum_BT = b_BT.long().cumsum(1)
        index_BT = torch.where(valid_BT, cum_BT - 1, -1)
        count_B = cum_BT[:, -1]
        if capacity is not None:
            if capacity < T:
                raise ValueError(f"concept capacity {capacity} < {T} tokens per row could drop concepts")
            M = max(capacity, 1)
        elif length is not None:
            M = length
        else:
            M = concept_len(count_B)
        arange_M = torch.arange(M, device=h_BTD.device)[None].expand(B, M)
        valid_BM = arange_M < count_B[:, None]
        start_BM = torch.searchsorted(cum_BT, arange_M + 1).clamp(max=T - 1)  # boundary token of m
        prob_BM = torch.where(valid_BM, p_BT.gather(1, start_BM), 0.0)
        if self.cfg.concept_merge == "last":
            x_BMD = h_BTD.gather(1, start_BM[..., None].expand(B, M, D))
            x_BMD = torch.where(valid_BM[..., None], x_BMD, 0.0)
        else:
            member_BT = valid_BT & (index_BT >= 0)
            rows_BT = torch.arange(B, device=h_BTD.device)[:, None].expand(B, T)
            x_BMD = h_BTD.new_zeros(B, M, D).index_put(
                (rows_BT, index_BT.clamp(min=0)), torch.where(member_BT[..., None], h_BTD, 0.0), accumulate=True)
        segment_BM = None
        position_BM = arange_M
        if segment_BT is not None:
            segment_BM = torch.where(valid_BM, segment_BT.gather(1, start_BM), 0)
            position_BM = concept_positions(segment_BM)
        return Concepts(x_BMD, valid_BM, position_BM, segment_BM, prob_BM, index_BT, count_B)


CONCEPT_SYNC = "chunking: the number of concepts M (longest row) is the concept sequence's length"


@torch.compiler.disable  # a host read: under torch.compile one graph break here
def concept_len(count_B: torch.Tensor) -> int:
    """M, the longest row's concept count (at least 1): the concept sequence's length."""
    with host_sync(CONCEPT_SYNC):  # host sync: M is a shape
        return max(int(count_B.max()), 1)


def concept_positions(segment_BM: torch.Tensor) -> torch.Tensor:
    """0, 1, ... restarting at each change of segment id along the row."""
    B, M = segment_BM.shape
    arange_M = torch.arange(M, device=segment_BM.device)[None].expand(B, M)
    starts = segment_BM != F.pad(segment_BM[:, :-1], (1, 0), value=-1)
    first = torch.where(starts, arange_M, torch.zeros_like(arange_M)).cummax(1).values
    return arange_M - first


def form_concepts_reference(merge: str, h_BTD, b_BT, p_BT, valid_BT, segment_BT) -> Concepts:
    """Plain reference of ``ChunkModule.form_concepts`` (boolean-mask indexing: host syncs on CUDA)."""
    B, T, D = h_BTD.shape
    index_BT = torch.where(valid_BT, b_BT.long().cumsum(1) - 1, torch.full_like(b_BT, -1, dtype=torch.long))
    count_B = b_BT.sum(1)
    M = max(int(count_B.max()), 1)
    rows_BT = torch.arange(B, device=h_BTD.device)[:, None].expand(B, T)
    x_BMD = h_BTD.new_zeros(B, M, D)
    if merge == "last":
        x_BMD = x_BMD.index_put((rows_BT[b_BT], index_BT[b_BT]), h_BTD[b_BT])
    else:
        tok = valid_BT & (index_BT >= 0)
        x_BMD = x_BMD.index_put((rows_BT[tok], index_BT[tok]), h_BTD[tok], accumulate=True)
    valid_BM = torch.arange(M, device=h_BTD.device)[None] < count_B[:, None]
    prob_BM = p_BT.new_zeros(B, M).index_put((rows_BT[b_BT], index_BT[b_BT]), p_BT[b_BT])
    segment_BM, position_BM = None, torch.arange(M, device=h_BTD.device)[None].expand(B, M)
    if segment_BT is not None:
        segment_BM = segment_BT.new_zeros(B, M).index_put((rows_BT[b_BT], index_BT[b_BT]), segment_BT[b_BT])
        position_BM = concept_positions(segment_BM)
    return Concepts(x_BMD, valid_BM, position_BM, segment_BM, prob_BM, index_BT, count_B)


# achieved ratio R = tokens / concepts ------------------------------------------------------------
def concept_counts(boundary_BT, valid_BT, image_BT=None) -> dict[str, torch.Tensor]:
    """Real tokens and concepts (boundaries at real tokens) per row; with an image-token mask, also
    ``tokens_image`` / ``concepts_image`` and ``tokens_text`` / ``concepts_text`` (the other real
    tokens). Sum the counts over rows, batches or ranks, then divide with ``achieved_ratio``."""
    valid_BT = valid_BT.bool()
    b_BT = boundary_BT.bool() & valid_BT
    out = {"tokens": valid_BT.sum(1), "concepts": b_BT.sum(1)}
    if image_BT is not None:
        img_BT = image_BT.bool() & valid_BT
        txt_BT = valid_BT & ~img_BT
        out.update(tokens_image=img_BT.sum(1), concepts_image=(b_BT & img_BT).sum(1),
                   tokens_text=txt_BT.sum(1), concepts_text=(b_BT & txt_BT).sum(1))
    return out


def achieved_ratio(tokens, concepts):
    """R = tokens / concepts, for numbers or tensors; concepts are floored at 1."""
    if torch.is_tensor(concepts):
        return tokens / concepts.clamp(min=1)
    return tokens / max(concepts, 1)
