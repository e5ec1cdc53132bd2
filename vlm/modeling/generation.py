"""Step-wise decoding with token KV caches and the compressed concept cache.

Prefill runs the ordinary forward over the prompt with a ``DecodeState``: every token layer's cache
is filled, and each concept layer's cache receives one entry per COMPLETED concept. Each new token
then runs the encoder layers, decides its boundary online from the cached previous router key
(``boundary_prob``, the same fp32 formula as the full forward), steps the concept model only when a
new concept is complete (one cache entry per concept; rows without a new concept discard the step),
updates the EMA, and runs the decoder layers. ``concept_merge="last"`` steps the concept model with
the new boundary token itself; ``"sum"`` steps it with the running sum of the chunk the boundary
just closed (see chunking.py for why that is causal).

``decode_loop`` is the sampling loop (greedy, temperature, top-p, top-k, eos) used by the HF
wrappers' ``generate``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm.modeling.attention import KVCache
from vlm.modeling.chunking import IMAGE, boundary_prob
from vlm.modeling.conceptmoe import ConceptMoEModel


@dataclass
class DecodeState:
    token_caches: list
    concept_caches: list
    next_pos_B: torch.Tensor | None = None
    prev_k_BD: torch.Tensor | None = None
    ema_BD: torch.Tensor | None = None  # EMA of the concept tokens currently read
    has_ema_B: torch.Tensor | None = None
    run_sum_BD: torch.Tensor | None = None  # "sum": running sum of the open chunk
    run_p_B: torch.Tensor | None = None  # "sum": p of the open chunk's boundary token
    prev_modality_B: torch.Tensor | None = None

    @classmethod
    def allocate(cls, model: ConceptMoEModel, batch: int, capacity: int, device, dtype) -> "DecodeState":
        cfg = model.cfg
        kv = cfg.num_key_value_heads
        def cache(layer):
            return KVCache(batch, kv, capacity, layer.attn.head_dim, device, dtype)
        token_layers = list(model.encoder) + list(model.decoder)
        concept = [cache(model.concept_model[i]) for i in model.schedule]
        return cls([cache(l) for l in token_layers], concept)

    # prefill hooks (called by ConceptMoEModel.forward) -----------------------------------------
    def concept_fill(self, con, merge: str):
        """Concept caches keep completed concepts only: "sum" drops the still-open last chunk."""
        count = con.count_B - (1 if merge == "sum" else 0)
        valid = torch.arange(con.valid_BM.shape[1], device=count.device)[None] < count[:, None]
        return valid, count.clamp(min=0)

    def after_prefill(self, model, h_BTD, con, c_hat_BMD, position_BT, modality_BT):
        from vlm.modeling.dechunk import ema_scan
        B = h_BTD.shape[0]
        rows = torch.arange(B, device=h_BTD.device)
        _, k = model.chunker.query_key(h_BTD[:, -1:])
        self.prev_k_BD = k[:, 0]
        ema_BMD = ema_scan(c_hat_BMD, con.prob_BM)
        last = (con.count_B - 1).clamp(min=0)
        if model.cfg.concept_merge == "last":
            self.ema_BD = ema_BMD[rows, last]
            self.has_ema_B = con.count_B > 0
        else:
            prev = (con.count_B - 2).clamp(min=0)
            self.ema_BD = ema_BMD[rows, prev]
            self.has_ema_B = con.count_B > 1
            self.run_sum_BD = con.x_BMD[rows, last]
            self.run_p_B = con.prob_BM[rows, last]
        self.prev_modality_B = modality_BT[:, -1] if modality_BT is not None else None


@torch.no_grad()
def decode_step(model: ConceptMoEModel, state: DecodeState, input_ids_B1: torch.Tensor) -> torch.Tensor:
    """One token per row through the whole backbone; returns the normed hidden state [B, 1, D]."""
    cfg = model.cfg
    x = model.embed_tokens(input_ids_B1)
    pos = state.next_pos_B[:, None]
    cos_sin = model.rope(pos, cfg.hidden_size, x.dtype)
    for layer, cache in zip(model.encoder, state.token_caches):
        x, _ = layer(x, cos_sin, cache=cache)
        cache.advance()
    concept = None
    if cfg.chunking:
        x, concept = _chunk_step(model, state, x, pos)
    for layer, cache in zip(model.decoder, state.token_caches[model.n_enc:]):
        x, _ = layer(x, cos_sin, cache=cache, concept_BTD=concept if layer.attn.joint else None)
        cache.advance()
    state.next_pos_B = state.next_pos_B + 1
    return model.norm(x)


def _chunk_step(model: ConceptMoEModel, state: DecodeState, h_B1D, pos_B1):
    cfg, ch = model.cfg, model.chunker
    q, k = ch.query_key(h_B1D)
    p_B = boundary_prob(q[:, 0], state.prev_k_BD)
    state.prev_k_BD = k[:, 0]
    if cfg.boundary_mode == "dynamic":
        b_B = p_B >= 0.5
    elif cfg.boundary_mode == "fixed":
        b_B = (pos_B1[:, 0] % max(1, int(round(cfg.target_ratio)))) == 0
        p_B = b_B.float()
    else:
        b_B = torch.ones_like(p_B, dtype=torch.bool)
        p_B = torch.ones_like(p_B)
    if cfg.modality_policy == "split_at_switch" and state.prev_modality_B is not None:
        switch = state.prev_modality_B == IMAGE  # generated tokens are text
        b_B, p_B = b_B | switch, torch.where(switch, torch.ones_like(p_B), p_B)
        state.prev_modality_B = torch.zeros_like(state.prev_modality_B)
    h = h_B1D[:, 0]
    if cfg.concept_merge == "last":
        c_new, p_ema, commit = h, p_B, b_B
    else:
        c_new, p_ema, commit = state.run_sum_BD, state.run_p_B, b_B
    if bool(commit.any()):
        c_in = model.to_concept(c_new[:, None].to(h.dtype))
        ccos_sin = model.rope(state.concept_caches[0].len_B[:, None] if state.concept_caches else pos_B1,
                              c_in.shape[-1], h.dtype)
        c = c_in
        for slot, li in enumerate(model.schedule):
            cache = state.concept_caches[slot]
            c, _ = model.concept_model[li](c, ccos_sin, cache=cache)
            cache.advance(commit)
        c_hat = model.from_concept(c - c_in)[:, 0]
        p = p_ema[:, None].to(c_hat.dtype)
        new_ema = p * c_hat + (1 - p) * state.ema_BD
        state.ema_BD = torch.where(commit[:, None], new_ema, state.ema_BD)
        state.has_ema_B = state.has_ema_B | commit
    if cfg.concept_merge == "sum":
        state.run_sum_BD = torch.where(b_B[:, None], h, state.run_sum_BD + h)
        state.run_p_B = torch.where(b_B, p_B, state.run_p_B)
    read = state.ema_BD * state.has_ema_B[:, None].to(h.dtype)
    return h_B1D + read[:, None], read[:, None]  # STE factor is exactly 1 in the forward pass


def sample_next(logits_BV: torch.Tensor, do_sample: bool, temperature: float, top_p: float,
                top_k: int, generator=None) -> torch.Tensor:
    if not do_sample or temperature <= 0:
        return logits_BV.argmax(-1)
    logits = logits_BV.float() / temperature
    if top_k and top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_l, idx = logits.sort(-1, descending=True)
        cum = sorted_l.softmax(-1).cumsum(-1)
        drop = cum - sorted_l.softmax(-1) > top_p
        sorted_l = sorted_l.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_l)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


@torch.no_grad()
def decode_loop(prefill_fn, step_fn, input_ids_BT, max_new_tokens: int, do_sample=False, temperature=1.0,
                top_p=1.0, top_k=0, eos_token_id=None, pad_token_id=0, generator=None) -> torch.Tensor:
    """Generic loop: ``prefill_fn() -> logits[B, V]`` then ``step_fn(tokens_B) -> logits[B, V]``."""
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    logits = prefill_fn()
    done = torch.zeros(input_ids_BT.shape[0], dtype=torch.bool, device=input_ids_BT.device)
    out = [input_ids_BT]
    for i in range(max_new_tokens):
        nxt = sample_next(logits, do_sample, temperature, top_p, top_k, generator)
        nxt = torch.where(done, torch.full_like(nxt, pad_token_id), nxt)
        out.append(nxt[:, None])
        if eos:
            done = done | torch.isin(nxt, torch.tensor(sorted(eos), device=nxt.device))
        if bool(done.all()) or i == max_new_tokens - 1:
            break
        logits = step_fn(nxt)
    return torch.cat(out, 1)
