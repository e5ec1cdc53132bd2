"""Cached decoding: token KV caches, the compressed concept cache, one decoding step.

The prefill is the ordinary forward over the prompt with a ``DecodeState``. Each new token then
runs the encoder layers, the chunk step (the same boundary rule, concept merge and EMA recurrence
as the full forward, continued through the state's ``ChunkCarry``), the concept model only where a
concept completes (one cache entry per concept), and the decoder layers. ``generate`` is
transformers' own loop (greedy, sampling, beam search, ...) over a ``ConceptCache`` (cache.py) that
holds one ``DecodeState``; see hf.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .attention import KVCache
from .chunking import TEXT, ChunkCarry
from .conceptmoe import ConceptMoEModel


CONCEPT_HEADROOM = 16  # concept slots beyond capacity / R (forced boundaries: segment / modality starts)
CONCEPT_GROWTH = 16  # a full concept cache grows by 1 / CONCEPT_GROWTH of its capacity (whole headroom pages)


def planned_ratio(cfg) -> float:
    """The compression the concept caches are sized for: 1 for ``boundary_mode: all``, the rounded
    stride for ``fixed``, else the smallest target (per-modality targets included)."""
    if not cfg.chunking or cfg.boundary_mode == "all":
        return 1.0
    if cfg.boundary_mode == "fixed":
        return float(max(1, int(round(cfg.target_ratio))))
    return float(min(r for r in (cfg.target_ratio, cfg.image_target_ratio, cfg.text_target_ratio) if r))


def concept_capacity(capacity: int, ratio: float) -> int:
    """Concept slots planned for ``capacity`` token positions: ceil(capacity / R) + headroom."""
    return math.ceil(capacity / ratio) + CONCEPT_HEADROOM


def grown_capacity(capacity: int) -> int:
    """The next size of a full concept cache: 1 / CONCEPT_GROWTH more, rounded up to whole pages of
    CONCEPT_HEADROOM slots. Small steps, since an achieved R a little under the planned one overflows
    the plan by a few slots only (doubling would allocate the token caches' size again); still
    geometric, so the copies cost O(1) amortised per entry."""
    page = max(1, CONCEPT_HEADROOM)
    return capacity + max(1, math.ceil(capacity / CONCEPT_GROWTH / page)) * page


class ConceptKVCache(KVCache):
    """A concept layer's ``KVCache``, allocated at ``concept_capacity`` and grown (reallocated larger,
    entries copied) when more concepts arrive than planned: to the prompt's concepts + headroom at the
    prefill, by ``grown_capacity`` when a decoding step finds it full. The token caches keep their
    fixed capacity."""

    def grow(self, capacity: int) -> None:
        """Room for ``capacity`` entries: the held ones copied, the new slots empty (invalid)."""
        extra = capacity - self.capacity
        if extra <= 0:
            return
        B, H, _, D = self.k.shape
        self.k = torch.cat([self.k, self.k.new_zeros(B, H, extra, D)], 2)
        self.v = torch.cat([self.v, self.v.new_zeros(B, H, extra, D)], 2)
        self.valid_BC = torch.cat([self.valid_BC, self.valid_BC.new_zeros(B, extra)], 1)

    def fill(self, k_BHTD, v_BHTD, valid_BT, len_B) -> None:
        self.grow(k_BHTD.shape[2] + CONCEPT_HEADROOM)
        super().fill(k_BHTD, v_BHTD, valid_BT, len_B)

    def step(self, k_BH1D, v_BH1D):
        if int(self.len_B.max()) >= self.capacity:  # (KVCache.step reads the same number)
            self.grow(grown_capacity(self.capacity))
        return super().step(k_BH1D, v_BH1D)


@dataclass
class DecodeState(ChunkCarry):
    """Everything cached decoding carries from one token to the next.

    ``ConceptMoEModel.forward(state=...)`` (the prefill, on a fresh state) fills ``token_caches``
    (encoder then decoder layers; every token), ``concept_caches`` (one per entry of the concept
    schedule; the completed concepts, ``Concepts.completed_B``), ``next_pos_B`` and the
    ``ChunkCarry`` fields; ``decode_step`` continues from there.
    """
    token_caches: list
    concept_caches: list
    next_pos_B: torch.Tensor | None = None

    @classmethod
    def allocate(cls, model: ConceptMoEModel, batch: int, capacity: int, device, dtype) -> "DecodeState":
        """Token caches of ``capacity`` slots; concept caches (``ConceptKVCache``) of
        ``concept_capacity(capacity, planned_ratio(cfg))``, grown when needed."""
        cfg = model.cfg
        kv = cfg.num_key_value_heads
        n_concepts = concept_capacity(capacity, planned_ratio(cfg))
        token_layers = list(model.encoder) + list(model.decoder)
        tokens = [KVCache(batch, kv, capacity, layer.attn.head_dim, device, dtype) for layer in token_layers]
        concept = [ConceptKVCache(batch, kv, n_concepts, model.concept_model[i].attn.head_dim, device, dtype)
                   for i in model.schedule]
        return cls(tokens, concept)


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
        x, concept = chunk_step(model, state, x, pos)
    for layer, cache in zip(model.decoder, state.token_caches[model.n_enc:]):
        x, _ = layer(x, cos_sin, cache=cache, concept_BTD=concept if layer.attn.joint else None)
        cache.advance()
    state.next_pos_B = state.next_pos_B + 1
    return model.norm(x)


def chunk_step(model: ConceptMoEModel, state: DecodeState, h_B1D, pos_B1):
    """Chunk -> concept model -> dechunk for one new (text) token per row. Returns the decoder input
    z and the concept signal it reads, both [B, 1, D] (the STE factor is exactly 1 in the forward)."""
    ch, merge = model.chunker, model.cfg.concept_merge
    valid_B1 = torch.ones_like(pos_B1, dtype=torch.bool)
    modality_B1 = None if state.prev_modality_B is None else torch.full_like(pos_B1, TEXT)
    b_B1, p_B1 = ch.boundaries(h_B1D, valid_B1, pos_B1, modality_BT=modality_B1, carry=state)
    b_B, h_BD = b_B1[:, 0], h_B1D[:, 0]
    concept_BD, weight_B = state.merge(merge, h_BD, b_B, p_B1[:, 0])
    if bool(b_B.any()):
        state.update_ema(_concept_step(model, state, concept_BD, b_B), weight_B, b_B)
    read_BD = state.read()
    return h_B1D + read_BD[:, None], read_BD[:, None]


def _concept_step(model: ConceptMoEModel, state: DecodeState, concept_BD, commit_B) -> torch.Tensor:
    """The concept model on one new concept per row; only rows in ``commit_B`` keep the cache entry.
    Returns c_hat (the concept model's update, see dechunk.py) [B, D]."""
    c_in = model.to_concept(concept_BD[:, None])
    ccos_sin = model.rope(state.concept_caches[0].len_B[:, None], c_in.shape[-1], c_in.dtype)
    c = c_in
    for slot, li in enumerate(model.schedule):
        cache = state.concept_caches[slot]
        c, _ = model.concept_model[li](c, ccos_sin, cache=cache)
        cache.advance(commit_B)
    return model.from_concept(c - c_in)[:, 0]
