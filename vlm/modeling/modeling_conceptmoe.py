"""Hugging Face wrappers: ``ConceptMoEForCausalLM`` (PreTrainedModel + GenerationMixin), Auto classes.

``save_pretrained`` writes safetensors; ``from_pretrained`` reads safetensors only (a folder that
holds only pickles is refused unless ``trust_pickle=True``; see ``vlm/modeling/safe_loading.py``).

``generate`` is transformers' ``GenerationMixin.generate`` on our cached decoding: the forward with a
``ConceptCache`` (cache.py) runs the prefill on a fresh ``DecodeState`` and ``decode_step`` for each later
token (``generate(decode="compiled")``: the fixed-shape step, captured as CUDA graphs on CUDA;
decode_graph.py). Supported: greedy, sampling (temperature, top_p, top_k, ... logits processors), repetition
penalty, beam search and beam sampling, eos lists / stop strings, ``streamer``, ``return_dict_in_generate``
with ``output_scores`` / ``output_logits``, ``num_return_sequences``, ``use_cache=False`` (repeated full
forwards). Refused in one line (``check_generation``): assisted / speculative / prompt-lookup decoding,
contrastive search, DoLa, group / constrained beam search, classifier-free guidance, ``cache_implementation``,
chunked prefill, attentions / hidden states outputs, ``generator=`` (seed with ``torch.manual_seed``). The
generation config holds only the config's special token ids: the config's ``top_k`` is the MoE's experts per
token, not a sampling flag.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.generation.configuration_utils import GenerationMode
from transformers.utils import GENERATION_CONFIG_NAME, ModelOutput

from .configuration_conceptmoe import ConceptMoEConfig
from .attention import Attention
from .cache import ConceptCache
from .chunking import TEXT, ChunkModule
from .conceptmoe import CompressionStats, ConceptMoEModel
from .decode_graph import decode
from .generation import DecodeState, check_decode
from .hf_features import generation_cache_key
from .moe import MoEFeedForward
from .legacy_experts import fuse_after_from_pretrained
from .lm_loss import chunked_lm_loss, lm_loss_fn
from .safe_loading import require_safetensors


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
    cache: ConceptCache | None = None


def loss_only(model: nn.Module, on: bool = True) -> int:
    """Forwards with labels of every ``ConceptMoEForCausalLM`` in ``model`` (a VLM's language model
    too) return the loss without logits (``chunked_lm_loss``); the trainer's setting. Returns how many."""
    lms = [m for m in model.modules() if isinstance(m, ConceptMoEForCausalLM)]
    for lm in lms:
        lm.logits_with_loss = not on
    return len(lms)


def total_loss(cfg: ConceptMoEConfig, lm, ratio, lb, z):
    loss = lm + cfg.router_aux_loss_coef * lb + cfg.router_z_loss_coef * z
    if cfg.chunking:
        loss = loss + cfg.ratio_loss_weight * ratio
    return loss


SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH,
                   GenerationMode.BEAM_SAMPLE)
REFUSED_KWARGS = {
    "assistant_model": "assisted / speculative decoding needs a cache that can be cropped back",
    "custom_generate": "custom decoding loops are not run on the concept cache",
    "negative_prompt_ids": "classifier-free guidance runs a second cache the concept cache does not provide",
    "generator": "transformers samples with the global RNG: seed it with torch.manual_seed",
    "segment_ids": "packed segments are a training layout, not a generation input",
    "labels": "generate computes no loss",
}


class ConceptMoEGenerationConfig(GenerationConfig):
    """Only ``from_model_config`` differs: it copies the special token ids of the (text) model config and
    nothing else, so the MoE's ``top_k`` (experts per token) never becomes a top-k sampling flag."""

    @classmethod
    def from_model_config(cls, model_config) -> GenerationConfig:
        if not isinstance(model_config, dict):
            model_config = model_config.get_text_config(decoder=True).to_dict()
        model_config = model_config.get("text_config") or model_config
        ids = {k: model_config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        config = GenerationConfig(**{k: v for k, v in ids.items() if v is not None}, _from_model_config=True)
        config._original_object_hash = hash(config)
        return config


def check_generation(config: GenerationConfig) -> None:
    """One line for every generation option the concept cache cannot serve (nothing is ignored)."""
    mode = config.get_generation_mode()
    if mode not in SUPPORTED_MODES:
        raise ValueError(f"ConceptMoE generate: {mode.value} is not supported with the concept cache "
                         f"(supported: {', '.join(m.value for m in SUPPORTED_MODES)})")
    refused = {
        "cache_implementation": (config.cache_implementation is not None,
                                 "generation always uses the ConceptCache (vlm/modeling/cache.py)"),
        "prefill_chunk_size": (config.prefill_chunk_size is not None, "the prefill runs on the whole prompt"),
        "output_attentions": (bool(config.output_attentions), "the model returns no attention weights"),
        "output_hidden_states": (bool(config.output_hidden_states), "the model returns no hidden states"),
        "guidance_scale": (config.guidance_scale not in (None, 1, 1.0),
                           "classifier-free guidance runs a second cache the concept cache does not provide"),
    }
    for name, (bad, why) in refused.items():
        if bad:
            raise ValueError(f"ConceptMoE generate: {name}={getattr(config, name)!r} is not supported: {why}")


def require_left_padding(attention_mask) -> None:
    if attention_mask is not None and attention_mask.dim() == 2 and bool((attention_mask[:, -1] == 0).any()):
        raise ValueError("generate expects left padding: the last column of attention_mask must be all 1")


class ConceptMoEPreTrainedModel(PreTrainedModel):
    config_class = ConceptMoEConfig
    generation_config_class = ConceptMoEGenerationConfig
    base_model_prefix = "model"
    _no_split_modules = ["TransformerBlock"]
    _supports_sdpa = True
    supports_gradient_checkpointing = True  # TransformerBlock.gradient_checkpointing (blocks.py)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, trust_pickle: bool = False, **kwargs):
        """Safetensors only, unless ``trust_pickle=True`` (see ``vlm/modeling/safe_loading.py``)."""
        require_safetensors(pretrained_model_name_or_path, trust_pickle)
        if not trust_pickle:
            kwargs["use_safetensors"] = True
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs)
        hub = {k: kwargs[k] for k in ("cache_dir", "revision", "local_files_only", "token") if k in kwargs}
        fuse_after_from_pretrained(model, pretrained_model_name_or_path, info, kwargs.get("subfolder") or "", **hub)
        return (model, info) if want_info else model

    def adjust_generation_fn(self, generation_config, from_auto_class, from_pipeline, pretrained_model_name_or_path,
                             *args, **kwargs):
        """A checkpoint without generation_config.json keeps the one built from its config (special token
        ids): transformers would otherwise read every generation-like key of config.json (``top_k``)."""
        if generation_config is None and pretrained_model_name_or_path is not None and \
                os.path.isdir(pretrained_model_name_or_path):
            sub = kwargs.get("subfolder") or ""
            if not os.path.isfile(os.path.join(pretrained_model_name_or_path, sub, GENERATION_CONFIG_NAME)):
                return
        super().adjust_generation_fn(generation_config, from_auto_class, from_pipeline, pretrained_model_name_or_path,
                                     *args, **kwargs)

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
            for w in (module.w_gate_up, module.w_down):
                init.normal_(w, mean=0.0, std=std)
        elif isinstance(module, ChunkModule):
            module.reset_router()
        elif isinstance(module, Attention) and module.joint:
            for lin in (module.q_c_proj, module.k_c_proj, module.v_c_proj):
                init.zeros_(lin.weight)  # joint decoding starts neutral


class ConceptMoEForCausalLM(ConceptMoEPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    logits_with_loss = True  # a forward with labels returns logits too (``loss_only`` turns it off)
    _decode_mode = "eager"  # the decoding mode of generate's fresh cache (``generate(decode=...)``)

    def __init__(self, config: ConceptMoEConfig):
        super().__init__(config)
        self.model = ConceptMoEModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                labels=None, segment_ids=None, modality_ids=None, cache: ConceptCache | None = None,
                logits_to_keep: int = 0, return_logits: bool | None = None, doc_layout=None,
                **kwargs) -> ConceptMoEOutput:
        """Full forward; with ``cache`` (generation) the prefill on a fresh cache, then one token per row.
        ``logits_to_keep=n`` computes the logits of the last n positions only (0: all).
        ``return_logits=False`` with labels (training, loss only): ``logits`` is None and the loss is
        ``chunked_lm_loss`` (no [B, T, V] logits); None takes ``self.logits_with_loss`` (True unless a
        trainer set it with ``loss_only``); otherwise logits + ``lm_loss_fn`` on them. ``doc_layout``: the
        packed rows' document layout built on the host (a packed batch's ``doc_layout``)."""
        if return_logits is None:
            return_logits = labels is None or self.logits_with_loss
        if not return_logits and labels is None:
            raise ValueError("return_logits=False needs labels: without them the forward returns only logits")
        if logits_to_keep and labels is not None:
            raise ValueError("logits_to_keep drops the logits the loss needs: pass labels without it")
        if cache is not None and cache.started:
            return self._decode(cache, input_ids, inputs_embeds, labels, segment_ids)
        state = None
        if cache is not None:
            if labels is not None or segment_ids is not None:
                raise ValueError("a forward with a ConceptCache takes no labels or segment_ids")
            require_left_padding(attention_mask)
            ref = inputs_embeds if inputs_embeds is not None else input_ids
            p = next(self.parameters())
            state = cache.state = DecodeState.allocate(self.model, ref.shape[0], cache.capacity, p.device, p.dtype,
                                                       decode=cache.decode)
        out = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                         position_ids=position_ids, segment_ids=segment_ids, modality_ids=modality_ids, state=state,
                         doc_layout=doc_layout)
        if return_logits:
            logits = self.lm_head(out.hidden_BTD[:, -logits_to_keep:] if logits_to_keep else out.hidden_BTD)
            lm = lm_loss_fn(logits, labels) if labels is not None else None
        else:
            logits, lm = None, chunked_lm_loss(self.lm_head, out.hidden_BTD, labels)
        loss = total_loss(self.config, lm, out.ratio_loss, out.lb_loss, out.z_loss) if lm is not None else None
        compression = None
        if out.boundary_BT is not None:
            valid = attention_mask.bool() if attention_mask is not None else torch.ones_like(out.boundary_BT)
            compression = CompressionStats(out.boundary_BT, valid, modality_ids)
        return ConceptMoEOutput(loss=loss, logits=logits, lm_loss=lm, ratio_loss=out.ratio_loss,
                                lb_loss=out.lb_loss, z_loss=out.z_loss, boundary_mask=out.boundary_BT,
                                boundary_probs=out.prob_BT, num_concepts=out.num_concepts_B,
                                compression=compression, tokens_per_expert=out.tokens_per_expert, cache=cache)

    def _decode(self, cache: ConceptCache, input_ids, inputs_embeds, labels, segment_ids) -> ConceptMoEOutput:
        """One new token per row on a started cache, in the cache's ``decode`` mode; logits [B, 1, V]."""
        if inputs_embeds is not None or labels is not None or segment_ids is not None:
            raise ValueError("a started ConceptCache takes input_ids only (no inputs_embeds, labels, segment_ids)")
        if input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] != 1:
            shape = None if input_ids is None else tuple(input_ids.shape)
            raise ValueError(f"a started ConceptCache takes one new token per row (input_ids [B, 1]), got {shape}")
        logits = self.lm_head(decode(self.model, cache.state, input_ids))
        return ConceptMoEOutput(logits=logits, cache=cache)

    # generation --------------------------------------------------------------------------------
    def start_decoding(self, batch: int, capacity: int, decode: str = "eager") -> DecodeState:
        """A fresh state for ``prefill`` then ``step``: ``capacity`` token slots per row; ``decode``: how
        the steps run (generation.DECODE_MODES: "eager", "static", "compiled"; decode_graph.py)."""
        p = next(self.parameters())
        return DecodeState.allocate(self.model, batch, capacity, p.device, p.dtype, decode=decode)

    def prefill(self, state: DecodeState, input_ids=None, inputs_embeds=None, attention_mask=None,
                modality_ids=None) -> torch.Tensor:
        """Low-level cached decoding (tests, benchmarks): the prompt on a fresh state; logits [B, V]."""
        out = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                         modality_ids=modality_ids, state=state)
        self._last_prefill = out
        return self.lm_head(out.hidden_BTD[:, -1])

    def step(self, state: DecodeState, tokens_B: torch.Tensor) -> torch.Tensor:
        return self.lm_head(decode(self.model, state, tokens_B[:, None])[:, 0])

    def release_decode_graphs(self) -> None:
        """Frees the fixed-shape decoding steps (buffers, compiled code's CUDA graphs, captured graphs)
        that ``decode="static"`` / ``"compiled"`` / ``"cudagraph"`` keep across calls (decode_pool.py)."""
        self.model.release_decode_graphs()

    @torch.no_grad()
    def generate(self, inputs=None, generation_config=None, decode: str | None = None, **kwargs):
        """``GenerationMixin.generate`` on the concept cache (see the module docstring); the model runs
        in eval mode and returns to its previous mode. Left-padded batches only. ``decode``: how the
        steps after the prefill run (generation.DECODE_MODES; None: "eager", or a given cache's mode):
        "compiled" the step under torch.compile (CUDA graphs on CUDA), "cudagraph" captured without
        compiling (CUDA only); decode_graph.py."""
        given = kwargs.get("cache", kwargs.get("past_key_values"))
        if decode is not None:
            p = next(self.parameters())
            check_decode(decode, p.device, p.dtype)
            if isinstance(given, ConceptCache) and given.decode != decode:
                raise ValueError(f"ConceptMoE generate: decode={decode!r} but the given cache decodes "
                                 f"{given.decode!r}")
        for name, why in REFUSED_KWARGS.items():
            if kwargs.get(name) is not None:
                raise ValueError(f"ConceptMoE generate: {name}= is not supported: {why}")
        require_left_padding(kwargs.get("attention_mask"))
        was_training = self.training
        self.eval()
        self._decode_mode = decode or "eager"  # for _prepare_cache_for_generation
        try:
            return super().generate(inputs, generation_config, **kwargs)
        finally:
            self.train(was_training)
            self._decode_mode = "eager"

    def _prepare_generation_config(self, generation_config, **kwargs):
        config, model_kwargs = super()._prepare_generation_config(generation_config, **kwargs)
        check_generation(config)
        return config, model_kwargs

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length) -> None:
        """A fresh ``ConceptCache`` sized for prompt + new tokens; a given one must be a ConceptCache (it
        grows to that size: a continued generation)."""
        key = generation_cache_key()  # "cache" or, on transformers 5.17, "past_key_values"
        given = model_kwargs.pop("cache", None)
        given = model_kwargs.pop("past_key_values", None) if given is None else given
        if given is not None:
            if not isinstance(given, ConceptCache):
                raise ValueError(f"ConceptMoE generate: a {type(given).__name__} cache is not supported: pass a "
                                 "ConceptCache (vlm/modeling/cache.py) or none")
            given.ensure_capacity(max_cache_length + 1)
            model_kwargs[key] = given
            return
        if generation_config.use_cache is False and self._decode_mode != "eager":
            raise ValueError(f"ConceptMoE generate: decode={self._decode_mode!r} needs the cache (use_cache=False "
                             "runs repeated full forwards)")
        if generation_config.use_cache is not False:
            model_kwargs[key] = ConceptCache(max_cache_length + 1, decode=self._decode_mode)

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, cache=None, attention_mask=None,
                                      inputs_embeds=None, is_first_iteration=False, modality_ids=None,
                                      position_ids=None, use_cache=None, logits_to_keep=None,
                                      past_key_values=None, **kwargs):
        """Started cache: the last token only (the state knows positions, padding and modality). Fresh
        cache (the prefill): the whole prompt, as ``inputs_embeds`` when given. No cache: the whole
        sequence so far, new tokens being text. The cache comes as ``cache`` or ``past_key_values``
        (``hf_features.generation_cache_key``)."""
        cache = past_key_values if cache is None else cache
        extra = sorted(k for k, v in kwargs.items() if v is not None and k not in ("tokenizer", "assistant_tokenizer"))
        if extra:  # (the tokenizers are stop_strings' / the loop's, not model inputs)
            raise ValueError(f"ConceptMoE generate: unsupported model inputs {extra}")
        if cache is not None and cache.started:
            if is_first_iteration and (input_ids.shape[0] != cache.batch_size or
                                       input_ids.shape[1] != cache.get_seq_length() + 1):
                raise ValueError(f"ConceptMoE generate: a started ConceptCache continues [{cache.batch_size}, "
                                 f"{cache.get_seq_length() + 1}] ids (its sequences + one token), "
                                 f"got {list(input_ids.shape)}")
            return {"input_ids": input_ids[:, -1:], "cache": cache, "logits_to_keep": logits_to_keep}
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                  "cache": cache, "logits_to_keep": logits_to_keep}
        if inputs_embeds is not None and cache is not None:
            inputs.update(input_ids=None, inputs_embeds=inputs_embeds)
        if modality_ids is not None:
            new = max(input_ids.shape[1] - modality_ids.shape[1], 0)  # > 0 only without a cache
            inputs["modality_ids"] = F.pad(modality_ids, (0, new), value=TEXT)
        return inputs


AutoConfig.register("conceptmoe", ConceptMoEConfig, exist_ok=True)
AutoModelForCausalLM.register(ConceptMoEConfig, ConceptMoEForCausalLM, exist_ok=True)
# save_pretrained copies this package's files (transformers' custom_object_save) and writes auto_map, so an
# export loads with trust_remote_code=True where our packages are not installed
ConceptMoEForCausalLM.register_for_auto_class("AutoModelForCausalLM")
