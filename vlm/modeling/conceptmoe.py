"""The ConceptMoE language backbone: encoder -> chunk -> concept model -> dechunk -> decoder.

With ``chunking=False`` this is the plain MoE baseline: the same ``layers`` run in sequence. With
chunking on, ``layers`` is split into L_E encoder layers (tokens), L_C concept layers (concepts,
width d_c, top-k ``concept_top_k``, optionally looped) and L_D decoder layers (tokens; the last K
use joint decoding). Parameter names are identical in both modes, so a trained baseline converts
to a ConceptMoE by copying its weights (see ``vlm/convert.py``).

The model holds no training, distributed or file code. ``forward(state=...)`` is the prefill of
cached decoding: see ``DecodeState`` (generation.py) for what it fills.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .configuration_conceptmoe import ConceptMoEConfig
from . import attention, varlen
from .attention import RMSNorm, rope_cos_sin
from .blocks import TransformerBlock
from .chunking import CONCEPT_SYNC, IMAGE, ChunkModule, achieved_ratio, concept_counts
from .dechunk import dechunk
from .moe import TokenMask
from .runtime import RuntimeOptions, scan_impl, use_tokens_capacity
from .syncs import host_sync

PAD_SYNC = ("conceptmoe: whether unpacked rows hold padding (none: plain causal attention, no document "
            "layout); packed rows skip it, their layout covers the padding")


PROMPT_SYNC = ("prefill: the prompt's attention mask copied to the host once, before any kernel is queued; its "
               "padding check and token layout are computed on that copy (HOST_LAYOUT)")
HOST_LAYOUT = ("prefill: the padding checks and document layouts computed on the host (the copy of the attention "
               "mask, the concept counts; CPU tensors, no device read: named so that a CPU-only count tells them apart)")

CHECKPOINT_MODES = ("none", "selective", "full")

def concept_capacity(T: int, host_layout: bool, device: torch.device, opts: RuntimeOptions) -> int | None:
    """The ``capacity`` handed to ``form_concepts``: T or None (read M), see ``RuntimeOptions.capacity``
    (``auto``: T on CUDA for host-laid-out batches once the GPU verdicts say so; on the CPU the read waits
    for nothing and M < T slots cost less)."""
    return T if use_tokens_capacity(opts, host_layout, device.type) else None


@dataclass
class BackboneOutput:
    hidden_BTD: torch.Tensor
    lb_loss: torch.Tensor
    z_loss: torch.Tensor
    ratio_loss: torch.Tensor
    boundary_BT: torch.Tensor | None = None
    prob_BT: torch.Tensor | None = None
    num_concepts_B: torch.Tensor | None = None
    tokens_per_expert: list = field(default_factory=list)


def concept_schedule(cfg: ConceptMoEConfig) -> list[int]:
    """Order in which concept layers run; looped layers repeat with their own weights."""
    loops = set(cfg.concept_loop_layers)
    return [i for i in range(cfg.concept_layers) for _ in range(cfg.concept_loop_times if i in loops else 1)]


class ConceptMoEModel(nn.Module):
    def __init__(self, cfg: ConceptMoEConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        L, attn, moe = cfg.num_hidden_layers, cfg.attention, cfg.moe
        n_enc = cfg.encoder_layers if cfg.chunking else L
        n_dec = cfg.decoder_layers if cfg.chunking else 0
        n_con = L - n_enc - n_dec
        d_c = cfg.concept_hidden_size or d
        joint_from = L - min(cfg.joint_decoding_layers, n_dec) if cfg.chunking else L
        layers = []
        for i in range(L):
            in_concept = n_enc <= i < n_enc + n_con
            layers.append(TransformerBlock(
                attn, moe, d_c if in_concept else d, dense=i < cfg.first_k_dense,
                top_k=(cfg.concept_top_k if in_concept else None), joint=i >= joint_from))
        self.layers = nn.ModuleList(layers)
        self.n_enc, self.n_con = n_enc, n_con
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        if cfg.chunking:
            self.chunker = ChunkModule(d, cfg)  # the live config, not a copy
            if d_c != d:
                self.concept_in = nn.Linear(d, d_c, bias=False)
                self.concept_out = nn.Linear(d_c, d, bias=False)
        self.schedule = concept_schedule(cfg) if cfg.chunking else []
        for layer in self.layers:
            layer.attn.model_config = cfg  # its runtime choices (cfg.runtime.varlen_kernel), read live

    # pieces ------------------------------------------------------------------------------------
    @property
    def encoder(self):
        return self.layers[: self.n_enc]

    @property
    def concept_model(self):
        return self.layers[self.n_enc: self.n_enc + self.n_con]

    @property
    def decoder(self):
        return self.layers[self.n_enc + self.n_con:]

    def to_concept(self, x):
        return self.concept_in(x) if hasattr(self, "concept_in") else x

    def from_concept(self, x):
        return self.concept_out(x) if hasattr(self, "concept_out") else x

    def set_activation_checkpointing(self, mode: str) -> int:
        """Which part of every block (token and concept layers) the training backward recomputes:
        "none", "selective" (the FFN half) or "full" (the whole block; see blocks.py), with the
        non-reentrant torch checkpoint (transformers' ``..._disable`` leaves a bare one). Returns the
        number of blocks."""
        if mode not in CHECKPOINT_MODES:
            raise ValueError(f"activation checkpointing must be one of {', '.join(CHECKPOINT_MODES)}, got {mode!r}")
        for layer in self.layers:
            layer.gradient_checkpointing = mode == "full"
            layer.checkpoint_ffn = mode == "selective"
            layer._gradient_checkpointing_func = type(layer)._gradient_checkpointing_func
        return len(self.layers)

    def rope(self, position_BT, hidden: int, dtype):
        head_dim = self.cfg.head_dim or hidden // self.cfg.num_attention_heads
        return rope_cos_sin(position_BT, head_dim, self.cfg.rope_theta, dtype,
                            getattr(self.cfg, "rope_scaling_params", None))

    def _run(self, layers, x, cos_sin, mask, valid, acc, caches=None, fill=None, concept=None):
        for i, layer in enumerate(layers):
            cache = caches[i] if caches is not None else None
            x, stats = layer(x, cos_sin, mask=mask, valid_BT=valid, cache=cache, fill=fill,
                             concept_BTD=concept if layer.attn.joint else None)
            if stats is not None:
                acc.append(stats)
        return x

    # forward -----------------------------------------------------------------------------------
    def release_decode_graphs(self) -> None:
        """Frees the fixed-shape decoding steps kept across ``generate`` calls (decode_pool.py)."""
        graphs = self.__dict__.get("_decode_graphs")
        if graphs is not None:
            graphs.release()

    def _apply(self, fn, *args, **kwargs):
        """A move or dtype change (``to``, ``cuda``, ``half``, ...) frees the kept decoding steps: their
        buffers and graphs are of the old device and dtype."""
        self.release_decode_graphs()
        return super()._apply(fn, *args, **kwargs)

    def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None, position_ids=None,
                segment_ids=None, modality_ids=None, state=None, doc_layout=None) -> BackboneOutput:
        """``doc_layout``: the token stack's `DocLayout` of these ``attention_mask`` / ``segment_ids``, built
        on the host (``data_pipelines.collate``: packed batches carry it); None builds it here, or for the
        prefill (``state``) on a host copy of the mask (``prompt_layout``: one read, before any kernel)."""
        host = None
        if state is not None and attention_mask is not None and doc_layout is None and segment_ids is None:
            host = prompt_layout(attention_mask)
            doc_layout = host[1]
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T, _ = x.shape
        valid_BT = attention_mask.bool() if attention_mask is not None else \
            torch.ones(B, T, dtype=torch.bool, device=x.device)
        if position_ids is None:
            position_ids = (valid_BT.long().cumsum(1) - 1).clamp(min=0)
        # one mask per stack, shared by its layers: a DocLayout (per document, no T x T) or None
        if host is not None:
            mvalid = valid_BT if host[0] else None
        else:
            mvalid = padding(valid_BT if attention_mask is not None else None, segment_ids, doc_layout)
        mask = attention.attention_mask(mvalid, segment_ids, T, x.device, layout=doc_layout,
                                        impl=self.cfg.runtime.attention)
        cos_sin = self.rope(position_ids, self.cfg.hidden_size, x.dtype)
        tok_fill = (mvalid, T)  # token caches: every row continues at slot T; None: no padding
        stats: list = []
        caches = state.token_caches if state is not None else None
        if state is not None:
            state.next_pos_B = position_ids[:, -1] + 1
        tok_valid = TokenMask.of(mvalid)  # the token stacks' MoE layers share its count and complement
        h = self._run(self.encoder, x, cos_sin, mask, tok_valid, stats, caches, tok_fill)
        zero = x.new_zeros((), dtype=torch.float32)
        out = BackboneOutput(h, zero, zero, zero)
        if self.cfg.chunking:
            h = self._chunked(h, valid_BT, position_ids, segment_ids, modality_ids, tok_valid, cos_sin,
                              mask, stats, out, state, tok_fill, self._concept_capacity(T, doc_layout, state, x.device),
                              doc_layout)
        out.hidden_BTD = self.norm(h)
        if stats:
            out.lb_loss = torch.stack([s.lb_loss for s in stats]).mean()
            out.z_loss = torch.stack([s.z_loss for s in stats]).mean()
            out.tokens_per_expert = [s.tokens_per_expert for s in stats]
        return out

    def _concept_capacity(self, T: int, doc_layout, state, device) -> int | None:
        """``concept_capacity``; the prefill (``state``) reads the concept count: the concept caches are
        filled with it and sized by it (capacity T would make them as large as the token caches)."""
        return None if state is not None else concept_capacity(T, doc_layout is not None, device, self.cfg.runtime)

    def _chunked(self, h, valid_BT, position_ids, segment_ids, modality_ids, tok_valid, cos_sin, mask,
                 stats, out, state, tok_fill, capacity=None, doc_layout=None):
        cfg, ch = self.cfg, self.chunker
        merge = cfg.concept_merge
        b_BT, p_BT = ch.boundaries(h, valid_BT, position_ids, segment_ids, modality_ids, carry=state)
        if state is None:  # (generation: no training losses)
            out.ratio_loss = ch.aux_loss(p_BT, b_BT, valid_BT, modality_ids)
        counts = None
        if state is not None and capacity is None and segment_ids is None:  # the prefill: one read of the counts
            counts = prompt_concept_counts(b_BT)
        con = ch.form_concepts(h, b_BT, p_BT, valid_BT, segment_ids, capacity,
                               length=None if counts is None else max(max(counts), 1))
        c_in = self.to_concept(con.x_BMD)
        cmask = None
        if capacity is not None and doc_layout is not None:  # from the host's token layout: no device read
            cval = con.valid_BM
            cmask = self._concept_layout(mask if isinstance(mask, varlen.DocLayout) else doc_layout, b_BT, c_in)
        elif counts is not None:  # the concepts' padding and layout from the host's counts: no device read
            clayout = concept_layout_from_counts(counts, c_in.shape[1])
            cval = None if clayout is None else con.valid_BM
            cmask = attention.attention_mask(cval, None, c_in.shape[1], h.device, layout=clayout,
                                             impl=cfg.runtime.attention)
        else:
            cval = padding(con.valid_BM, con.segment_BM)
        if cmask is None:
            cmask = attention.attention_mask(cval, con.segment_BM, c_in.shape[1], h.device, impl=cfg.runtime.attention)
        ccos_sin = self.rope(con.position_BM, c_in.shape[-1], h.dtype)
        cval_moe = TokenMask.of(cval)  # prepared once for the concept stack's MoE layers
        c = c_in
        cfill = None
        if state is not None:  # concept caches keep the completed concepts only
            done_B = con.completed_B(merge)
            cfill = (torch.arange(con.valid_BM.shape[1], device=h.device)[None] < done_B[:, None], done_B)
        for slot, li in enumerate(self.schedule):
            cache = state.concept_caches[slot] if state is not None else None
            c, st = self.concept_model[li](c, ccos_sin, mask=cmask, valid_BT=cval_moe, cache=cache, fill=cfill)
            if st is not None:
                stats.append(st)
        c_hat = self.from_concept(c - c_in)  # the concept model's update (see dechunk.py)
        scan = scan_impl(cfg.runtime, c_hat.device.type)
        z, read_BTD = dechunk(h, c_hat, con.prob_BM, p_BT, b_BT, con.index_BT, merge,
                              con.segment_BM, segment_ids, scan_impl=scan)
        if state is not None:
            state.start(con, c_hat, merge, scan_impl=scan)
        caches = state.token_caches[self.n_enc:] if state is not None else None
        z = self._run(self.decoder, z, cos_sin, mask, tok_valid, stats, caches, tok_fill, concept=read_BTD)
        out.boundary_BT, out.prob_BT, out.num_concepts_B = b_BT, p_BT, con.count_B
        return z

    def _concept_layout(self, doc_layout, b_BT, c_in):
        """The concept stack's `DocLayout` at capacity T from the host's token layout
        (``varlen.concept_layout``), where the attention kernel needs no length buckets; else None."""
        if self.cfg.runtime.attention != "varlen":
            return None
        attn = self.concept_model[0].attn
        kernel = varlen.kernel_for(c_in.device, c_in.dtype, attn.head_dim, self.cfg.runtime.varlen_kernel)
        if kernel == "bucketed":
            return None
        return varlen.concept_layout(doc_layout, b_BT, varlen.TAIL if kernel == "flash" else 1)


def padding(valid_BT: torch.Tensor | None, segment_BT: torch.Tensor | None,
            layout: varlen.DocLayout | None = None) -> torch.Tensor | None:
    """The padding mask a stack's layers get: None when every position is real (the MoE layers then
    mask nothing). Packed rows (``segment_BT``) keep ``valid_BT`` unread: their document layout reads
    the device once anyway, padding included; a layout built on the host (``layout``, the collator's)
    says whether there is any. Unpacked rows are checked (a named host read) so that rows without
    padding run plain causal attention with no layout."""
    if valid_BT is not None and layout is not None and layout.padded is False:
        return None
    if valid_BT is None or segment_BT is not None:
        return valid_BT
    with host_sync(PAD_SYNC):
        has_pad = not bool(valid_BT.all())
    return valid_BT if has_pad else None


def prompt_layout(attention_mask: torch.Tensor) -> tuple[bool, varlen.DocLayout | None]:
    """(whether the prompt holds padding, its token `DocLayout` built on the host or None without padding)
    from one copy of ``attention_mask`` to the host, made before the prefill queues any kernel."""
    with host_sync(PROMPT_SYNC):
        valid_BT = attention_mask.detach().to("cpu", torch.bool)
    with host_sync(HOST_LAYOUT):
        if bool(valid_BT.all()):
            return False, None
    return True, varlen.DocLayout.on_host(valid_BT, None, reason=HOST_LAYOUT)


def prompt_concept_counts(b_BT: torch.Tensor) -> list[int]:
    """The prefill's concepts per row, read once (``CONCEPT_SYNC``: M is the concept sequence's length; the
    same transfer gives every row's count, so the concept stack's padding and layout need no other read)."""
    with host_sync(CONCEPT_SYNC):
        return b_BT.long().sum(1).tolist()


def concept_layout_from_counts(counts: list[int], M: int) -> varlen.DocLayout | None:
    """The concept stack's `DocLayout` for rows of ``counts`` concepts right-padded to M, built on the host
    (None: no padding, plain causal attention)."""
    if min(counts) == M:
        return None
    valid_BM = torch.arange(M)[None] < torch.tensor(counts)[:, None]
    return varlen.DocLayout.on_host(valid_BM, None, reason=HOST_LAYOUT)


class CompressionStats(Mapping):
    """``compression_stats`` computed on first read: a training step that never looks at it reads
    nothing from the device for it."""

    def __init__(self, boundary_BT, valid_BT, modality_BT=None):
        self._args, self._stats = (boundary_BT.detach(), valid_BT, modality_BT), None

    def _get(self) -> dict:
        if self._stats is None:
            self._stats = compression_stats(*self._args)
        return self._stats

    def __getitem__(self, key):
        return self._get()[key]

    def __iter__(self):
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __repr__(self) -> str:
        return repr(self._get())


def compression_stats(boundary_BT, valid_BT, modality_BT=None) -> dict:
    """Achieved ratio R = tokens / concepts: per sample, pooled, and per modality."""
    n = concept_counts(boundary_BT, valid_BT, None if modality_BT is None else modality_BT == IMAGE)
    stats = {"ratio_per_sample": achieved_ratio(n["tokens"].float(), n["concepts"].float()),
             "ratio": float(achieved_ratio(n["tokens"].sum().float(), n["concepts"].sum().float()))}
    if modality_BT is not None:
        for name in ("image", "text"):
            tokens = int(n[f"tokens_{name}"].sum())
            if tokens:
                stats[f"ratio_{name}"] = achieved_ratio(tokens, int(n[f"concepts_{name}"].sum()))
    return stats
