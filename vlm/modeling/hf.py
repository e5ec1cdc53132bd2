"""Hugging Face wrappers: ``ConceptMoEForCausalLM`` (PreTrainedModel + GenerationMixin), Auto classes.

``save_pretrained`` writes safetensors; ``from_pretrained`` reads safetensors only (a folder that
holds only pickles is refused unless ``trust_pickle=True``; see ``vlm/safe_loading.py``).
``generate`` keeps the HF signature but runs our own cached decoding (``generation.py``), because
the concept cache advances per row and is not an HF ``Cache``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.utils import ModelOutput

from vlm.config import ConceptMoEConfig
from vlm.modeling.attention import Attention
from vlm.modeling.chunking import ChunkModule
from vlm.modeling.conceptmoe import ConceptMoEModel, compression_stats
from vlm.modeling.generation import DecodeState, decode_loop, decode_step
from vlm.modeling.moe import MoEFeedForward
from vlm.safe_loading import require_safetensors


@dataclass
class ConceptMoEOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    lm_loss: torch.Tensor | None = None
    ratio_loss: torch.Tensor | None = None
    lb_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None
    boundary_mask: torch.Tensor | None = None
    boundary_probs: torch.Tensor | None = None
    num_concepts: torch.Tensor | None = None
    compression: dict | None = None
    tokens_per_expert: list | None = None


def lm_loss_fn(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy; labels are aligned with inputs (shifted here), -100 ignored."""
    shift_logits = logits_BTV[:, :-1].float()
    shift_labels = labels_BT[:, 1:]
    if not bool((shift_labels != -100).any()):
        return shift_logits.sum() * 0.0
    return F.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1),
                           ignore_index=-100)


def total_loss(cfg: ConceptMoEConfig, lm, ratio, lb, z):
    loss = lm + cfg.router_aux_loss_coef * lb + cfg.router_z_loss_coef * z
    if cfg.chunking:
        loss = loss + cfg.ratio_loss_weight * ratio
    return loss


class ConceptMoEPreTrainedModel(PreTrainedModel):
    config_class = ConceptMoEConfig
    base_model_prefix = "model"
    _no_split_modules = ["TransformerBlock"]
    _supports_sdpa = True

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, trust_pickle: bool = False, **kwargs):
        """Safetensors only, unless ``trust_pickle=True`` (see ``vlm/safe_loading.py``)."""
        require_safetensors(pretrained_model_name_or_path, trust_pickle)
        if not trust_pickle:
            kwargs["use_safetensors"] = True
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def _initialize_weights(self, module, is_custom_code: bool = False):
        # For "custom code" (any model outside transformers) modules without direct parameters
        # (Attention, ChunkModule) are skipped, which would skip the joint projections' zero init and
        # the router init of ``_init_weights``. That only uses the guarded
        # ``transformers.initialization`` functions, so loaded weights are never touched.
        super()._initialize_weights(module, is_custom_code=False)

    def _init_weights(self, module):
        PreTrainedModel._init_weights(self, module)
        std = self.config.get_text_config().initializer_range
        if isinstance(module, MoEFeedForward):
            for w in (module.w_gate, module.w_up, module.w_down):
                init.normal_(w, mean=0.0, std=std)
        elif isinstance(module, ChunkModule):
            module.reset_router()
        elif isinstance(module, Attention) and module.joint:
            for lin in (module.q_c_proj, module.k_c_proj, module.v_c_proj):
                init.zeros_(lin.weight)  # joint decoding starts neutral


class ConceptMoEForCausalLM(ConceptMoEPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: ConceptMoEConfig):
        super().__init__(config)
        self.model = ConceptMoEModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        if getattr(self, "generation_config", None) is not None:
            self.generation_config.top_k = None  # copied from config.top_k (MoE experts), not sampling

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                labels=None, segment_ids=None, modality_ids=None, **kwargs) -> ConceptMoEOutput:
        out = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                         position_ids=position_ids, segment_ids=segment_ids, modality_ids=modality_ids)
        logits = self.lm_head(out.hidden_BTD)
        lm = lm_loss_fn(logits, labels) if labels is not None else None
        loss = total_loss(self.config, lm, out.ratio_loss, out.lb_loss, out.z_loss) if lm is not None else None
        compression = None
        if out.boundary_BT is not None:
            valid = attention_mask.bool() if attention_mask is not None else torch.ones_like(out.boundary_BT)
            compression = compression_stats(out.boundary_BT, valid, modality_ids)
        return ConceptMoEOutput(loss=loss, logits=logits, lm_loss=lm, ratio_loss=out.ratio_loss,
                                lb_loss=out.lb_loss, z_loss=out.z_loss, boundary_mask=out.boundary_BT,
                                boundary_probs=out.prob_BT, num_concepts=out.num_concepts_B,
                                compression=compression, tokens_per_expert=out.tokens_per_expert)

    # generation --------------------------------------------------------------------------------
    def start_decoding(self, batch: int, capacity: int) -> DecodeState:
        p = next(self.parameters())
        return DecodeState.allocate(self.model, batch, capacity, p.device, p.dtype)

    def prefill(self, state: DecodeState, input_ids=None, inputs_embeds=None, attention_mask=None,
                modality_ids=None) -> torch.Tensor:
        out = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                         modality_ids=modality_ids, state=state)
        self._last_prefill = out
        return self.lm_head(out.hidden_BTD[:, -1])

    def step(self, state: DecodeState, tokens_B: torch.Tensor) -> torch.Tensor:
        return self.lm_head(decode_step(self.model, state, tokens_B[:, None])[:, 0])

    @torch.no_grad()
    def generate(self, input_ids=None, attention_mask=None, max_new_tokens: int = 20, do_sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, eos_token_id=None,
                 pad_token_id=None, inputs_embeds=None, modality_ids=None, generator=None, **kwargs):
        """Left-padded batch in, ``[B, T + new]`` token ids out (HF-style signature)."""
        if kwargs.get("generation_config") is not None:
            gc = kwargs["generation_config"]
            max_new_tokens = gc.max_new_tokens or max_new_tokens
        was_training = self.training
        self.eval()
        ids = input_ids if input_ids is not None else torch.zeros(inputs_embeds.shape[:2], dtype=torch.long,
                                                                    device=inputs_embeds.device)
        B, T = ids.shape
        if attention_mask is not None and bool((attention_mask[:, -1] == 0).any()):
            raise ValueError("generate expects left padding: the last column of attention_mask must be all 1")
        state = self.start_decoding(B, T + max_new_tokens + 1)
        eos = eos_token_id if eos_token_id is not None else self.config.eos_token_id
        pad = pad_token_id if pad_token_id is not None else (self.config.pad_token_id or 0)
        try:
            return decode_loop(
                lambda: self.prefill(state, input_ids, inputs_embeds, attention_mask, modality_ids),
                lambda tok: self.step(state, tok), ids, max_new_tokens, do_sample, temperature, top_p, top_k,
                eos, pad, generator)
        finally:
            self.train(was_training)


AutoConfig.register("conceptmoe", ConceptMoEConfig, exist_ok=True)
AutoModelForCausalLM.register(ConceptMoEConfig, ConceptMoEForCausalLM, exist_ok=True)
