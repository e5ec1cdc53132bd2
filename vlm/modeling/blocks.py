"""Transformer block: pre-norm attention + pre-norm FFN (MoE, or dense for the first k layers).

The same block is used by the encoder, concept model and decoder; a decoder block built with
``joint=True`` takes the per-token concept signal into its attention (joint decoding).

Activation checkpointing (training only: module in train mode, grad enabled, no KV cache): with
``gradient_checkpointing`` (transformers' flag, set by ``gradient_checkpointing_enable`` or
``ConceptMoEModel.set_activation_checkpointing("full")``) the whole block runs under
``_gradient_checkpointing_func`` (non-reentrant ``torch.utils.checkpoint``): only its inputs are kept
and the backward recomputes it. With ``checkpoint_ffn`` ("selective") only the FFN half
(post-attention norm + MoE / dense FFN) is recomputed: the MoE keeps the most bytes per FLOP of
recompute (the K-fold gathered tokens, the [N*K, I] expert activations, routing; measured in
vlm/training/activation_checkpointing.py). Reentrant checkpointing is refused (it would detach the MoE stats).
The MoE stats (aux losses) come out of the first run with their graph; nothing in a block draws
random numbers, so a recompute is exact.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .configuration_conceptmoe import AttentionConfig, MoEConfig
from .attention import Attention, KVCache, RMSNorm
from .moe import MoEFeedForward, MoEStats, SwiGLU

REENTRANT = ("TransformerBlock: reentrant checkpointing (use_reentrant=True or unset) detaches the MoE aux losses "
             "(not tensor outputs); pass use_reentrant=False")


class TransformerBlock(nn.Module):
    gradient_checkpointing = False  # recompute the whole block in the backward (transformers' flag)
    checkpoint_ffn = False  # recompute the FFN half only (selective)
    _gradient_checkpointing_func = staticmethod(partial(checkpoint, use_reentrant=False))

    def __init__(self, attn_cfg: AttentionConfig, moe_cfg: MoEConfig, hidden: int, dense: bool = False,
                 top_k: int | None = None, joint: bool = False):
        super().__init__()
        self.input_norm = RMSNorm(hidden, attn_cfg.rms_norm_eps)
        self.attn = Attention(attn_cfg, hidden, joint=joint)
        self.post_attn_norm = RMSNorm(hidden, attn_cfg.rms_norm_eps)
        self.ffn = SwiGLU(hidden, moe_cfg.dense_intermediate_size) if dense else \
            MoEFeedForward(hidden, moe_cfg, top_k=top_k)

    @property
    def is_moe(self) -> bool:
        return not isinstance(self.ffn, SwiGLU)  # routed: MoEFeedForward, or its expert-parallel form

    def forward(self, x_BTD: torch.Tensor, cos_sin, mask=None, valid_BT=None, cache: KVCache | None = None,
                fill=None, concept_BTD=None) -> tuple[torch.Tensor, MoEStats | None]:
        if self.gradient_checkpointing and self._recompute(cache):
            return self._checkpointed(self._forward, x_BTD, cos_sin, mask, valid_BT, None, None, concept_BTD)
        return self._forward(x_BTD, cos_sin, mask, valid_BT, cache, fill, concept_BTD)

    def _forward(self, x_BTD, cos_sin, mask, valid_BT, cache, fill, concept_BTD):
        x_BTD = x_BTD + self.attn(self.input_norm(x_BTD), cos_sin, mask=mask, cache=cache,
                                  concept_BTD=concept_BTD, fill=fill)
        if self.checkpoint_ffn and not self.gradient_checkpointing and self._recompute(cache):
            y, stats = self._checkpointed(self._ffn_half, x_BTD, valid_BT)
        else:
            y, stats = self._ffn_half(x_BTD, valid_BT, cache is None)
        return x_BTD + y, stats

    def _ffn_half(self, x_BTD, valid_BT, stats: bool = True):
        """``stats=False`` (generation, with a KV cache): no MoE losses or expert counts."""
        h = self.post_attn_norm(x_BTD)
        if self.is_moe:
            return self.ffn(h, valid_BT, stats=stats)
        return self.ffn(h), None

    def _recompute(self, cache) -> bool:
        return self.training and cache is None and torch.is_grad_enabled()

    def _checkpointed(self, fn, *args):
        func = self._gradient_checkpointing_func
        if func is checkpoint or (isinstance(func, partial) and func.keywords.get("use_reentrant", True)):
            raise ValueError(REENTRANT)
        return func(fn, *args)
