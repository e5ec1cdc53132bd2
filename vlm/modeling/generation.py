"""Cached decoding: token KV caches, the compressed concept cache, one decoding step.

The prefill is the ordinary forward over the prompt with a ``DecodeState``. Each new token then
runs the encoder layers, the chunk step (the same boundary rule, concept merge and EMA recurrence
as the full forward, continued through the state's ``ChunkCarry``), the concept model only where a
concept completes (one cache entry per concept), and the decoder layers; a step reads the device once
(ConceptMoE: the boundaries, which choose whether the concept model runs) or never (plain MoE), and
cache positions and lengths come from the host (``KVCache.size``). ``generate`` is
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
from .decode_pool import capacity_bucket
from .syncs import host_sync


# how decoding steps run (after the prefill): "eager" (``decode_step``: attends each cache up to its
# length, a new shape every token), "static" (fixed shapes over the whole capacity, eager), "compiled"
# (the fixed-shape step under torch.compile, CUDA graphs on CUDA) or "cudagraph" (the eager fixed-shape
# step captured as CUDA graphs, no compilation; CUDA only); decode_graph.py
DECODE_MODES = ("eager", "static", "compiled", "cudagraph")
CONCEPT_GROWTH = 16  # a full concept cache grows by 1 / CONCEPT_GROWTH of its capacity (whole headroom pages)


def planned_ratio(cfg) -> float:
    """The compression the concept caches are sized for: 1 for ``boundary_mode: all``, the rounded
    stride for ``fixed``, else the smallest target (per-modality targets included)."""
    if not cfg.chunking or cfg.boundary_mode == "all":
        return 1.0
    if cfg.boundary_mode == "fixed":
        return float(max(1, int(round(cfg.target_ratio))))
    return float(min(r for r in (cfg.target_ratio, cfg.image_target_ratio, cfg.text_target_ratio) if r))


def concept_capacity(capacity: int, ratio: float, headroom: int) -> int:
    """Concept slots planned for ``capacity`` token positions: ceil(capacity / R) + ``headroom`` (the
    model's ``runtime.concept_headroom``: forced boundaries, segment / modality starts)."""
    return math.ceil(capacity / ratio) + headroom


def grown_capacity(capacity: int, headroom: int) -> int:
    """The next size of a full concept cache: 1 / CONCEPT_GROWTH more, rounded up to whole pages of
    ``headroom`` slots. Small steps, since an achieved R a little under the planned one overflows
    the plan by a few slots only (doubling would allocate the token caches' size again); still
    geometric, so the copies cost O(1) amortised per entry."""
    page = max(1, headroom)
    return capacity + max(1, math.ceil(capacity / CONCEPT_GROWTH / page)) * page


class ConceptKVCache(KVCache):
    """A concept layer's ``KVCache``, allocated at ``concept_capacity`` and grown (reallocated larger,
    entries copied) when more concepts arrive than planned: to the prompt's concepts + headroom at the
    prefill, by ``grown_capacity`` before a decoding step that could find it full (``reserve``,
    a host check of the host bound: the step itself reads nothing). The token caches keep their fixed
    capacity."""

    def __init__(self, *args, headroom: int):
        super().__init__(*args)
        self.headroom = headroom  # runtime.concept_headroom

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
        self.grow(k_BHTD.shape[2] + self.headroom)
        super().fill(k_BHTD, v_BHTD, valid_BT, len_B)

    def reserve(self) -> None:
        """Between decoding steps (never inside one): room for the next entry of the longest row the
        host bound ``size`` allows, by ``grown_capacity`` when that row would not fit."""
        if self.size >= self.capacity:
            self.grow(grown_capacity(self.capacity, self.headroom))


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
    # host, not dataclass fields (``select_rows`` walks the fields): how later tokens are decoded
    # (DECODE_MODES) and the fixed-shape step that decodes them (decode_graph.StaticStep)
    decode = "eager"
    runner = None

    @classmethod
    def allocate(cls, model: ConceptMoEModel, batch: int, capacity: int, device, dtype,
                 decode: str = "eager") -> "DecodeState":
        """Token caches of ``capacity`` slots; concept caches (``ConceptKVCache``) of
        ``concept_capacity(capacity, planned_ratio(cfg), cfg.runtime.concept_headroom)``, grown when needed.
        ``decode``: one of ``DECODE_MODES``; a fixed-shape mode allocates ``capacity_bucket(capacity)`` token
        slots (the slots of the step it decodes on, decode_pool.py)."""
        check_decode(decode, torch.device(device), dtype)
        cfg = model.cfg
        kv = cfg.num_key_value_heads
        if decode != "eager":
            capacity = capacity_bucket(capacity)
        headroom = cfg.runtime.concept_headroom
        n_concepts = concept_capacity(capacity, planned_ratio(cfg), headroom)
        token_layers = list(model.encoder) + list(model.decoder)
        tokens = [KVCache(batch, kv, capacity, layer.attn.head_dim, device, dtype) for layer in token_layers]
        concept = [ConceptKVCache(batch, kv, n_concepts, model.concept_model[i].attn.head_dim, device, dtype,
                                  headroom=headroom)
                   for i in model.schedule]
        state = cls(tokens, concept)
        state.decode = decode
        return state


CAPTURED_DTYPE = torch.bfloat16  # the one dtype whose CUDA grouped GEMM reads nothing on the host


def check_decode(decode: str, device: torch.device | None = None, dtype: torch.dtype | None = None) -> str:
    """``decode`` if the model's device and dtype (when given) can run it, else one ``ValueError`` line.
    CUDA graphs on CUDA ("cudagraph", "compiled") need bf16: torch's ``_grouped_mm`` serves other dtypes
    by a fallback that copies the expert offsets to the host, which a capture cannot do."""
    if decode not in DECODE_MODES:
        raise ValueError(f"decode={decode!r} is not a decoding mode: use one of {', '.join(DECODE_MODES)}")
    if decode == "cudagraph" and device is not None and device.type != "cuda":
        raise ValueError(f"decode='cudagraph' captures CUDA graphs: the model is on {device.type} "
                         "(use 'static', or 'compiled' for torch.compile)")
    if (decode in ("cudagraph", "compiled") and device is not None and device.type == "cuda"
            and dtype is not None and dtype != CAPTURED_DTYPE):
        raise ValueError(f"decode={decode!r} on CUDA captures the MoE, whose {str(dtype).removeprefix('torch.')} "
                         "grouped GEMM copies its offsets to the host: use model.to(torch.bfloat16), or "
                         "decode='static'")
    return decode


BOUNDARY_SYNC = ("decode: the boundary decision (whether any row runs the concept step) and the concept caches' "
                 "exact lengths, one read per token")


@torch.no_grad()
def decode_step(model: ConceptMoEModel, state: DecodeState, input_ids_B1: torch.Tensor) -> torch.Tensor:
    """One token per row through the whole backbone; returns the normed hidden state [B, 1, D].

    Three phases, each free of device reads (and so of graph breaks): ``token_phase`` (embedding,
    encoder layers, the chunker's boundary step), ``concept_phase`` (the concept layers, only when a
    row completes a concept) and ``decoder_phase``. Between the first two, ConceptMoE reads the
    boundaries on the host (``boundary_read``, the step's one host read): they choose whether the
    concept phase runs. The plain MoE reads nothing. Concept caches grow before the step, never
    inside it (``ConceptKVCache.reserve``)."""
    for cache in state.concept_caches:
        cache.reserve()
    x, cos_sin, chunk = token_phase(model, state, input_ids_B1)
    if chunk is not None:
        b_B, concept_BD, weight_B = chunk
        commit, lens = boundary_read(b_B, state.concept_caches)
        for cache in state.concept_caches:  # the host bound exact again (beam reordering loosens it)
            cache.size = max(lens)
        if any(commit):
            concept_phase(model, state, concept_BD, weight_B, b_B, max(n + c for n, c in zip(lens, commit)))
    return decoder_phase(model, state, x, cos_sin)


def token_phase(model: ConceptMoEModel, state: DecodeState, input_ids_B1: torch.Tensor):
    """Embedding and encoder layers (all layers of the plain MoE); with chunking, the boundary step
    for the new (text) token. Returns the hidden state [B, 1, D], the RoPE tables and, with chunking,
    (boundaries b_B, the concept that completes at them [B, D], its EMA weight [B]), else None."""
    cfg = model.cfg
    x = model.embed_tokens(input_ids_B1)
    pos_B1 = state.next_pos_B[:, None]
    cos_sin = model.rope(pos_B1, cfg.hidden_size, x.dtype)
    x = token_layers(x, cos_sin, model.encoder, state.token_caches)
    if not cfg.chunking:
        return x, cos_sin, None
    valid_B1 = torch.ones_like(pos_B1, dtype=torch.bool)
    modality_B1 = None if state.prev_modality_B is None else torch.full_like(pos_B1, TEXT)
    b_B1, p_B1 = model.chunker.boundaries(x, valid_B1, pos_B1, modality_BT=modality_B1, carry=state)
    b_B = b_B1[:, 0]
    concept_BD, weight_B = state.merge(cfg.concept_merge, x[:, 0], b_B, p_B1[:, 0])
    return x, cos_sin, (b_B, concept_BD, weight_B)


def decoder_phase(model: ConceptMoEModel, state: DecodeState, h_B1D, cos_sin) -> torch.Tensor:
    """Dechunk (with chunking: z = h + the concept signal the token reads, also the joint layers'
    input; the STE factor is exactly 1 in the forward), the decoder layers, the final norm."""
    concept_B1D = None
    if model.cfg.chunking:
        concept_B1D = state.read()[:, None]
        h_B1D = h_B1D + concept_B1D
    x = token_layers(h_B1D, cos_sin, model.decoder, state.token_caches[model.n_enc:], concept_B1D)
    state.next_pos_B = state.next_pos_B + 1
    return model.norm(x)


def token_layers(x_B1D, cos_sin, layers, caches, concept_B1D=None):
    """``layers`` (encoder or decoder) on one token per row, each writing its token cache; no device read."""
    for layer, cache in zip(layers, caches):
        x_B1D, _ = layer(x_B1D, cos_sin, cache=cache, concept_BTD=concept_B1D if layer.attn.joint else None)
        cache.advance()
    return x_B1D


def boundary_read(b_B: torch.Tensor, concept_caches: list) -> tuple[list[bool], list[int]]:
    """The decode step's one host read: the boundaries [B] and, in the same transfer, the concept
    caches' lengths per row (all caches equal: they advance together; zeros without concept layers)."""
    B = b_B.shape[0]
    parts = [b_B.long()] + ([concept_caches[0].len_B] if concept_caches else [])
    with host_sync(BOUNDARY_SYNC):
        values = torch.cat(parts).tolist()
    return [bool(v) for v in values[:B]], values[B:] or [0] * B


def concept_phase(model: ConceptMoEModel, state: DecodeState, concept_BD, weight_B, commit_B,
                  size: int | None) -> None:
    """The concept model on one new concept per row and the EMA update; only rows in ``commit_B``
    keep the cache entry and update their EMA (``size``: the longest concept cache row after the
    commits, known on the host; None for static caches, whose caller sets it)."""
    c_in = model.to_concept(concept_BD[:, None])
    ccos_sin = model.rope(state.concept_caches[0].len_B[:, None], c_in.shape[-1], c_in.dtype)
    c = c_in
    for slot, li in enumerate(model.schedule):
        cache = state.concept_caches[slot]
        c, _ = model.concept_model[li](c, ccos_sin, cache=cache)
        cache.advance(commit_B, size=size)
    c_hat_BD = model.from_concept(c - c_in)[:, 0]  # the concept model's update (see dechunk.py)
    state.update_ema(c_hat_BD, weight_B, commit_B)
