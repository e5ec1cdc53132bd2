"""Mixture of experts FFN: softmax top-k router, SwiGLU experts, dropless sorted dispatch.

Dispatch ("sorted", the fast path): every (token, expert) assignment is sorted by expert, the
tokens are gathered into one contiguous buffer of N * K rows (``token_reorder.gather_rows``), each
expert's contiguous segment goes through its weights in one ``torch._grouped_mm`` per projection
(gate + up, down; the routing weight scales each row inside the expert MLP, ``expert_mlp.py``), and
the outputs are summed back per token (``token_reorder.scatter_sum``). No token is ever dropped,
and nothing is read on the host: the segment ends (``offs``) stay on the device, and padding is not
removed (a data-dependent shape) but sorted behind every expert's segment, outside every group (not
computed, zero outputs and gradients).
Only where torch's grouped GEMM does not serve the device and dtype (probed once by
``features.grouped_mm_ok``: e.g. CUDA fp32 on some releases, a torch without ``_grouped_mm``) the
segments go through a per-expert loop over ``split`` sizes read on the host (a named host sync, see
syncs.py). ``MoEFeedForward.forward_loop`` (``moe_dispatch="loop"``) is the plain per-expert
reference (it removes the padding by boolean indexing), kept for tests.

Losses: switch-style load balancing ``E * sum_e f_e * P_e`` (f = fraction of assignments, P =
mean router probability) and the router z-loss ``mean(logsumexp(logits)^2)``, both over real
(non-padding) tokens only. ``tokens_per_expert`` is reported for logging. Fewer launches per layer:
a stack's padding mask prepared once (``TokenMask``), the top-k normalisation and the z-loss as
autograd functions with one-formula backwards (``NormalizeRows``, ``RouterZ``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import flop_counter

from .configuration_conceptmoe import MoEConfig
from .expert_mlp import grouped_swiglu_reference
from .features import grouped_mm_ok
from .fused_kernels import IMPL as KERNELS
from .legacy_experts import fuse_legacy_gate_up
from .syncs import host_sync
from .token_reorder import gather_rows, inverse_order, permute_rows, scatter_sum


@dataclass
class MoEStats:
    lb_loss: torch.Tensor
    z_loss: torch.Tensor
    tokens_per_expert: torch.Tensor  # [E], long


@dataclass
class TokenMask:
    """The real (non-padding) tokens of a stack's rows, prepared once per stack and forward for all its
    MoE layers (``of``): the flat mask, its complement and the count n (at least 1), fp32, and n^2.
    A layer given the plain [B, T] mask prepares its own."""
    keep_N: torch.Tensor  # bool [N]
    pad_N: torch.Tensor  # bool [N], ~keep_N
    n: torch.Tensor  # fp32 [], real tokens, at least 1
    n2: torch.Tensor  # fp32 [], n * n

    @classmethod
    def of(cls, valid: torch.Tensor | TokenMask | None) -> TokenMask | None:
        """From a [B, T] (or flat [N]) bool mask of the real tokens; a TokenMask or None as given."""
        if valid is None or isinstance(valid, TokenMask):
            return valid
        keep_N = valid.reshape(-1).bool()
        n = keep_N.sum().clamp(min=1).float()
        return cls(keep_N, ~keep_N, n, n * n)


class NormalizeRows(torch.autograd.Function):
    """``w / w.sum(-1, keepdim=True)`` (the same forward) with the backward in one formula,
    ``(g - sum(g * out)) / s``: 4 ops where autograd's quotient rule takes 7."""

    @staticmethod
    def forward(ctx, w_NK):
        s_N1 = w_NK.sum(-1, keepdim=True)
        out_NK = w_NK / s_N1
        ctx.save_for_backward(out_NK, s_N1)
        return out_NK

    @staticmethod
    def backward(ctx, g_NK):
        out_NK, s_N1 = ctx.saved_tensors
        return (g_NK - (g_NK * out_NK).sum(-1, keepdim=True)) / s_N1


class RouterZ(torch.autograd.Function):
    """``sum_n logsumexp(logits_n)^2`` over the rows not in ``pad_N`` (None: all), with its gradient
    ``2 lse_n softmax(logits_n)`` from the router's own probabilities ``probs_NE`` (3 ops; autograd's
    log-sum-exp and square backwards take 6 to 7)."""

    @staticmethod
    def forward(ctx, logits_NE, probs_NE, pad_N):
        lse_N = torch.logsumexp(logits_NE, -1)
        if pad_N is not None:
            lse_N = lse_N.masked_fill(pad_N, 0.0)
        ctx.save_for_backward(lse_N, probs_NE)
        return torch.dot(lse_N, lse_N)

    @staticmethod
    def backward(ctx, g):
        lse_N, probs_NE = ctx.saved_tensors
        return probs_NE * (lse_N * (2.0 * g))[:, None], None, None


class SwiGLU(nn.Module):
    """Dense FFN (shared expert, dense layers)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


GROUPED_MM = hasattr(torch, "_grouped_mm")
EXPERT_LAYOUT = "w_gate_up"  # the routed experts' parameters; training checkpoints record it (resume check)
SPLIT_SYNC = "moe: no grouped GEMM for this device / dtype; the per-expert split needs the segment sizes"


def grouped_swiglu(x_SD: torch.Tensor, offs_E: torch.Tensor, w_gate_up_ED2I, w_down_EID, rw_S=None,
                   tail: bool = True) -> torch.Tensor:
    """SwiGLU over contiguous per-expert segments of ``x_SD`` (rows sorted by expert): expert e takes
    rows [offs[e-1], offs[e]) (``offs_E``: int32 ends, on the device); each row's output scaled by its
    routing weight ``rw_S`` (None: unscaled). Rows from offs[-1] on belong to no expert: zero outputs
    (``tail`` False: the caller knows there are none, offs[-1] == rows).
    Gate and up are one stored weight [E, D, 2I] and one grouped GEMM (``expert_mlp.GroupedSwiGLU``,
    whose backward recomputes the activation product instead of keeping it)."""
    if GROUPED_MM and grouped_mm_ok(x_SD.device.type, x_SD.dtype):
        return KERNELS["swiglu"].apply(x_SD, offs_E, w_gate_up_ED2I, w_down_EID, rw_S, tail)  # GroupedSwiGLU or fused
    with host_sync(SPLIT_SYNC):  # host sync: torch.split needs the segment lengths as Python ints
        sizes = torch.diff(offs_E, prepend=offs_E.new_zeros(1)).tolist()
    return grouped_swiglu_reference(x_SD, sizes, w_gate_up_ED2I, w_down_EID, rw_S)


def grouped_mm_flops(a, b, offs=None, bias=None, out_dtype=None, *, out_val=None, **kwargs) -> int:
    """``FlopCounterMode`` formula for ``torch._grouped_mm`` (torch 2.14 has none, so the experts of
    the sorted dispatch would count zero): 2 multiply-adds per output element and contracted index,
    over the rows / columns inside the groups only (what the kernel computes)."""
    if offs is None:  # [G, M, K] x [G, K, N]: a batched matmul
        return 2 * math.prod(out_val.shape) * a.shape[-1]
    with host_sync("flop counting: the grouped length offs[-1] (FlopCounterMode only, never in training)"):
        used = int(offs[-1])
    if a.dim() == 2 and b.dim() == 3:  # [M, K] x [G, K, N] -> [M, N], M jagged
        return 2 * used * a.shape[1] * b.shape[2]
    if a.dim() == 3 and b.dim() == 2:  # [G, M, K] x [K, N] -> [M, N], N jagged
        return 2 * a.shape[1] * a.shape[2] * used
    return 2 * a.shape[0] * b.shape[1] * used  # [M, K] x [K, N] -> [G, M, N], K jagged (weight grads)


if GROUPED_MM and torch.ops.aten._grouped_mm not in flop_counter.flop_registry:
    flop_counter.register_flop_formula(torch.ops.aten._grouped_mm, get_raw=True)(grouped_mm_flops)


class MoEFeedForward(nn.Module):
    """Routed experts (+ optional shared expert). Stacked weights: ``w_gate_up`` [E, D, 2I] (gate
    columns, then up: one GEMM, see expert_mlp.py) and ``w_down`` [E, I, D]. A state dict holding the
    two halves as ``w_gate`` / ``w_up`` [E, D, I] (the layout before the fused weight) loads too."""

    def __init__(self, hidden: int, cfg: MoEConfig, top_k: int | None = None):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = top_k or cfg.top_k
        self.norm_topk_prob = cfg.norm_topk_prob
        self.dispatch = cfg.moe_dispatch
        inter = cfg.moe_intermediate_size
        self.router = nn.Linear(hidden, cfg.num_experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(cfg.num_experts, hidden, 2 * inter))
        self.w_down = nn.Parameter(torch.empty(cfg.num_experts, inter, hidden))
        self.shared = SwiGLU(hidden, cfg.shared_expert_intermediate_size) \
            if cfg.shared_expert_intermediate_size > 0 else None
        # Qwen2-MoE: the shared expert's output scaled by sigmoid(x W_g), one scalar per token
        self.shared_gate = nn.Linear(hidden, 1, bias=False) \
            if self.shared is not None and getattr(cfg, "shared_expert_gate", False) else None

    @property
    def w_gate(self) -> torch.Tensor:
        """[E, D, I], a view of ``w_gate_up``."""
        return self.w_gate_up[..., :self.w_down.shape[1]]

    @property
    def w_up(self) -> torch.Tensor:
        """[E, D, I], a view of ``w_gate_up``."""
        return self.w_gate_up[..., self.w_down.shape[1]:]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        fuse_legacy_gate_up(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def route(self, x_ND: torch.Tensor):
        logits_NE = self.router(x_ND).float()
        probs_NE = logits_NE.softmax(-1)
        weights_NK, experts_NK = probs_NE.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights_NK = NormalizeRows.apply(weights_NK)
        return logits_NE, probs_NE, weights_NK, experts_NK

    def experts_sorted(self, x_ND, weights_NK, experts_NK, keep_N=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The dropless grouped dispatch; no host sync. ``keep_N`` (optional, bool): the real tokens;
        the others' assignments are sorted after every expert's segment (id E), outside every group
        of the grouped GEMM (never computed; zero outputs and gradients, see ``grouped_swiglu``)."""
        N, K = experts_NK.shape
        _, order_S, ends_E, counts_E = sort_by_expert(experts_NK, self.num_experts, keep_N)
        token_S, inverse_NK = order_S // K, inverse_order(order_S)
        x_SD = gather_rows(x_ND, token_S, inverse_NK)
        rw_S = permute_rows(weights_NK.reshape(-1), order_S, inverse_NK).to(x_ND.dtype)
        # padding rows lie after the last segment: zero outputs and gradients (grouped_swiglu); without
        # padding every row is in a segment
        y_SD = grouped_swiglu(x_SD, ends_E.to(torch.int32), self.w_gate_up, self.w_down, rw_S,
                              tail=keep_N is not None)
        return scatter_sum(y_SD, token_S, inverse_NK, N), counts_E

    def experts_loop(self, x_ND, weights_NK, experts_NK) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference: one masked pass per expert (tests only)."""
        out = torch.zeros_like(x_ND)
        for e in range(self.num_experts):
            tok, slot = torch.where(experts_NK == e)
            if tok.numel() == 0:
                continue
            x_e = x_ND[tok]
            gate, up = (x_e @ self.w_gate_up[e]).chunk(2, -1)
            h = F.silu(gate) * up
            out = out.index_add(0, tok, (h @ self.w_down[e]) * weights_NK[tok, slot, None].to(x_ND.dtype))
        return out, torch.bincount(experts_NK.reshape(-1), minlength=self.num_experts)

    def forward(self, x_BTD: torch.Tensor, valid_BT: torch.Tensor | TokenMask | None = None, stats: bool = True):
        """Outputs [B, T, D] (zero at padding) and the stats (None with ``stats=False``: generation
        computes no losses); padding (``valid_BT`` False; or a stack's ``TokenMask``) never reaches
        the experts, the stats or the losses. No host sync wherever torch has a grouped GEMM for the
        device and dtype (CPU, CUDA bf16; see ``grouped_swiglu``)."""
        if self.dispatch == "loop":
            return self.forward_loop(x_BTD, valid_BT, stats)
        return self.forward_sorted(x_BTD, valid_BT, stats)

    def forward_sorted(self, x_BTD: torch.Tensor, valid_BT: torch.Tensor | TokenMask | None = None,
                       stats: bool = True):
        """Route, ``experts_sorted``, shared expert, losses (the expert-parallel layer swaps in its
        own ``experts_sorted``)."""
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        mask = TokenMask.of(valid_BT)
        keep_N = None if mask is None else mask.keep_N
        logits_NE, probs_NE, weights_NK, experts_NK = self.route(x_ND)
        y_ND, counts_E = self.experts_sorted(x_ND, weights_NK, experts_NK, keep_N)
        y_ND = self._add_shared(x_ND, y_ND)
        if keep_N is not None and self.shared is not None:  # the routed sum is already zero at padding
            y_ND = torch.where(keep_N[:, None], y_ND, 0.0)
        return y_ND.view(B, T, D), self.losses(logits_NE, probs_NE, counts_E, mask) if stats else None

    def forward_loop(self, x_BTD: torch.Tensor, valid_BT: torch.Tensor | TokenMask | None = None,
                     stats: bool = True):
        """Reference: the padding removed by boolean indexing, then ``experts_loop`` (tests only)."""
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        keep = None if valid_BT is None else TokenMask.of(valid_BT).keep_N
        if keep is not None:
            x_ND = x_ND[keep]
        logits_NE, probs_NE, weights_NK, experts_NK = self.route(x_ND)
        y_ND, counts_E = self.experts_loop(x_ND, weights_NK, experts_NK)
        y_ND = self._add_shared(x_ND, y_ND)
        if keep is not None:
            y_ND = x_BTD.new_zeros(B * T, D).index_put((keep.nonzero()[:, 0],), y_ND)
        return y_ND.view(B, T, D), self.losses(logits_NE, probs_NE, counts_E) if stats else None

    def _add_shared(self, x_ND, y_ND):
        if self.shared is None:
            return y_ND
        shared_ND = self.shared(x_ND)
        if self.shared_gate is not None:
            shared_ND = torch.sigmoid(self.shared_gate(x_ND)) * shared_ND
        return y_ND + shared_ND

    def losses(self, logits_NE, probs_NE, counts_E, keep_N: torch.Tensor | TokenMask | None = None) -> MoEStats:
        """Over the real tokens: all rows, or those in ``keep_N`` (a flat bool mask or a stack's
        ``TokenMask``; means as masked sums over a count that stays on the device)."""
        # lb = E * sum_e (counts_e / (n K)) * (P_sum_e / n): one dot product, the constants in one scale
        scale = self.num_experts / self.top_k
        if keep_N is None:
            n = max(probs_NE.shape[0], 1)
            z = RouterZ.apply(logits_NE, probs_NE, None) / n
            lb = torch.dot(counts_E.float(), probs_NE.sum(0)) * (scale / (n * n))
        else:  # padding rows zeroed (masked_fill: whatever they hold), the count from the stack's mask
            mask = TokenMask.of(keep_N)
            p_sum_E = probs_NE.masked_fill(mask.pad_N[:, None], 0.0).sum(0)
            z = RouterZ.apply(logits_NE, probs_NE, mask.pad_N) / mask.n
            lb = torch.dot(counts_E.float(), p_sum_E) * scale / mask.n2
        return MoEStats(lb_loss=lb, z_loss=z, tokens_per_expert=counts_E.detach())


def sort_by_expert(experts_NK: torch.Tensor, num_experts: int, keep_N: torch.Tensor | None = None):
    """The N * K assignments sorted by expert (stable), padding (``keep_N`` False) given id E and so
    sorted last. Returns (sorted expert ids, order, segment ends [E], counts [E]); no host sync."""
    N, K = experts_NK.shape
    flat_e = experts_NK.reshape(-1)
    if keep_N is not None:
        flat_e = experts_NK.masked_fill(~keep_N[:, None], num_experts).reshape(-1)
    sorted_e, order = flat_e.sort(stable=True)
    # bounds[e + 1] = assignments to experts <= e (bounds[0] = 0): segment ends and counts in 3 kernels
    bounds = torch.searchsorted(sorted_e, torch.arange(-1, num_experts, device=flat_e.device), right=True)
    return sorted_e, order, bounds[1:], bounds[1:] - bounds[:-1]


def combine(y_SD: torch.Tensor, order_S: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
    """The routing-weighted sum per token [N, D] of expert outputs ``y_SD`` whose row i holds assignment
    ``order_S[i]`` (a flat index n * K + k, as ``sort_by_expert`` orders them; rows past ``y_SD``'s
    end, assignments never sent anywhere, count zero). For outputs not yet weighted (the
    expert-parallel exchange); the local dispatch folds the weights into the expert MLP."""
    N, K = weights_NK.shape
    S = y_SD.shape[0]
    y_SD = y_SD * weights_NK.reshape(-1)[order_S[:S], None].to(y_SD.dtype)
    return scatter_sum(y_SD, order_S // K, inverse_order(order_S), N)


def init_moe_weights(module: MoEFeedForward, std: float) -> None:
    for w in (module.w_gate_up, module.w_down):
        nn.init.normal_(w, std=std)

