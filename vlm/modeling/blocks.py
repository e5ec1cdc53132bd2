"""Transformer block: pre-norm attention + pre-norm FFN (MoE, or dense for the first k layers).

The same block is used by the encoder, concept model and decoder; a decoder block built with
``joint=True`` takes the per-token concept signal into its attention (joint decoding).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from vlm.config import AttentionConfig, MoEConfig
from vlm.modeling.attention import Attention, KVCache, RMSNorm
from vlm.modeling.moe import MoEFeedForward, MoEStats, SwiGLU


class TransformerBlock(nn.Module):
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
        return isinstance(self.ffn, MoEFeedForward)

    def forward(self, x_BTD: torch.Tensor, cos_sin, mask=None, valid_BT=None, cache: KVCache | None = None,
                fill=None, concept_BTD=None) -> tuple[torch.Tensor, MoEStats | None]:
        x_BTD = x_BTD + self.attn(self.input_norm(x_BTD), cos_sin, mask=mask, cache=cache,
                                  concept_BTD=concept_BTD, fill=fill)
        h = self.post_attn_norm(x_BTD)
        if self.is_moe:
            y, stats = self.ffn(h, valid_BT)
        else:
            y, stats = self.ffn(h), None
        return x_BTD + y, stats
