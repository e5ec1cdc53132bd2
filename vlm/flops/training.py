"""Training FLOPs per token of what actually trains (``train_flops_per_token``): every matmul costs its
forward, plus one forward's worth for the input gradient where a gradient has to flow through it, plus one
for the weight gradient where its weights train. The attention map (QK^T, PV) has no weights: its
backward is two forwards' worth (gradients to both operands) wherever a gradient flows through it.

With everything training this is the usual 3 x forward (``flops_per_token(...)['train_total']``). A frozen
language model under a trained projector (LLaVA stage 1) costs forward + input gradient: 2 x the weight
matmuls + 3 x the attention map. The vision tower and the projector are not counted (LM FLOPs only)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from vlm.flops.accountant import Arch, _attn_params, _joint_params, _ratio, dechunk_flops_per_token


@dataclass(frozen=True)
class Trains:
    """Which parts get gradients. ``lm``: the LM's own weights (embeddings, layers, LM head); ``chunker``:
    the boundary router's W_q / W_k; ``grad_at_input``: something before or inside the LM's first layer
    trains (the vision tower or projector of a VLM, LoRA adapters), so the gradient flows back through
    every LM layer to its input even where the LM's weights are frozen."""
    lm: bool = True
    chunker: bool = True
    grad_at_input: bool = False

    @classmethod
    def of_counts(cls, trainable: dict, lora: bool = False) -> Trains:
        """From the trainable parameter counts per part (vision, projector, chunker, lm); with ``lora`` the
        lm part's trainable parameters are adapters inside its layers, its own weights are frozen."""
        adapters = lora and trainable.get("lm", 0) > 0
        return cls(lm=trainable.get("lm", 0) > 0 and not lora, chunker=trainable.get("chunker", 0) > 0,
                   grad_at_input=trainable.get("vision", 0) > 0 or trainable.get("projector", 0) > 0 or adapters)

    def describe(self) -> str:
        if self.lm:
            return "3 x forward (the LM trains)"
        if self.grad_at_input:
            return ("forward + input gradient (frozen LM, the gradient flows through it"
                    + (", the chunker trains" if self.chunker else "") + ")")
        return "forward, + backward after the chunker (frozen LM, only the chunker trains)" if self.chunker \
            else "forward only (nothing in or before the LM trains)"


def region_flops(cfg, seq_len: float, ratio: float | None = None, causal_half: bool = False) -> dict:
    """Forward FLOPs per token by region (enc: token layers before the chunker, all layers of a plain
    MoE; chunk: the router; con: concept layers and the concept projections; dec: decoder layers and the
    LM head; dechunk: the EMA scan), each split into ``weights`` (matmuls with a weight) and ``map``
    (the weightless attention map / scan). Sums to ``flops_per_token(...)['total']``."""
    a = Arch.of(cfg)
    R = _ratio(a, ratio)
    N = float(seq_len)
    out = {r: {"weights": 0.0, "map": 0.0} for r in ("enc", "chunk", "con", "dec", "dechunk")}
    map_factor = 0.5 if causal_half else 1.0
    for kind, w, dense, k, joint, runs in a.layers():
        scale, ctx = (runs / R, N / R) if kind == "con" else (1.0, N)
        ffn = 6 * w * a.dense_inter if dense else 2 * w * a.E + 6 * k * w * a.inter + 6 * w * a.shared
        r = out[kind]
        r["weights"] += scale * (2 * _attn_params(a, w) + ffn) + (2 * _joint_params(a) if joint else 0.0)
        r["map"] += scale * map_factor * 4 * ctx * a.heads * a.hd(w)
    out["dec"]["weights"] += 2 * a.d * a.vocab
    if a.chunking:
        out["chunk"]["weights"] = 4 * a.d * a.d
        out["dechunk"]["map"] = dechunk_flops_per_token(a.d, N, R)
        if a.width_c != a.d:
            out["con"]["weights"] += 4 * a.d * a.width_c / R
    return out


def train_flops_per_token(cfg, seq_len: float, ratio: float | None = None, causal_half: bool = False,
                          trains: Trains = Trains()) -> float:
    """Training FLOPs per token (forward + backward) of the language model when ``trains`` train."""
    a = Arch.of(cfg)
    chunker = trains.chunker and a.chunking
    before = trains.grad_at_input or trains.lm  # a trained weight at or before the LM's first layer
    # (input-gradient flag, weight-gradient flag) per region
    flags = {"enc": (before, trains.lm), "chunk": (before, chunker), "con": (before, trains.lm),
             "dec": (before or chunker, trains.lm)}
    total = 0.0
    for region, f in region_flops(a, seq_len, ratio, causal_half).items():
        if region == "dechunk":  # [Q, Q] scan weights (from the router) x [Q, d] concept states
            total += f["map"] * (1 + (2 if before else 1 if chunker else 0))
            continue
        g_in, g_w = flags[region]
        total += f["weights"] * (1 + g_in + g_w) + f["map"] * (1 + 2 * g_in)
    return total
