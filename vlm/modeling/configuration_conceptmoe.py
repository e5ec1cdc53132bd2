"""The language model's config: one typed section per component (attention, MoE, chunking) and
``ConceptMoEConfig``, their flat Hugging Face serialization (a plain ``config.json``).

YAML presets may be flat or sectioned (``attention:``, ``moe:``, ``chunking:``, ``layout:``);
``chunking: {enabled: true}`` sets the flat boolean ``chunking``. Overrides use the same names,
flat (``num_experts=16``) or dotted (``moe.num_experts=16``). ``runtime:`` (``runtime.capacity=exact``)
holds how the model computes (runtime.py): kept on the config object, not saved in exports."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from transformers import PretrainedConfig

from .config_base import ConfigError, NonNegInt, Num, PosInt, Section, build, check, fail, load_yaml
from .runtime import RuntimeOptions, runtime_options


class AttentionConfig(Section):
    hidden_size: PosInt = 64
    num_attention_heads: PosInt = 4
    num_key_value_heads: PosInt = 2
    head_dim: PosInt | None = None  # default hidden_size // num_attention_heads
    rope_theta: Num(gt=0) = 10000.0
    max_position_embeddings: PosInt = 4096
    rms_norm_eps: Num(gt=0) = 1e-6
    # imported families (vlm/hf_import): off by default, so existing checkpoints are unchanged
    qkv_bias: bool = False  # q/k/v projections with bias (Qwen2, Llama attention_bias)
    o_proj_bias: bool = False  # output projection with bias (Llama attention_bias)
    qk_norm: Literal["none", "head", "full"] = "none"  # RMSNorm of q/k per head (Qwen3) or whole projection (OLMoE)
    # transformers' rope_parameters of type linear / llama3 / yarn (rope_theta stays above); null = plain RoPE
    rope_scaling_params: dict[str, Any] | None = None

    def check_layout(self) -> None:
        check(self.hidden_size % self.num_attention_heads == 0, "attention.hidden_size",
              f"{self.hidden_size} is not divisible by attention.num_attention_heads={self.num_attention_heads}")
        check(self.num_attention_heads % self.num_key_value_heads == 0, "attention.num_key_value_heads",
              f"{self.num_key_value_heads} must divide attention.num_attention_heads={self.num_attention_heads}")
        if self.rope_scaling_params is not None:
            self._check_rope_scaling_params(self.rope_scaling_params)
        head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        check(head_dim % 2 == 0, "attention.head_dim" if self.head_dim else "attention.hidden_size",
              f"RoPE needs an even head dimension, got {head_dim}" + ("" if self.head_dim else
              f" (attention.hidden_size={self.hidden_size} / attention.num_attention_heads={self.num_attention_heads})"))


    @staticmethod
    def _check_rope_scaling_params(sc: dict) -> None:
        kind = sc.get("rope_type")
        need = _ROPE_KEYS.get(kind) if isinstance(kind, str) else None
        check(need is not None, "attention.rope_scaling_params",
              f"rope_type must be one of {sorted(_ROPE_KEYS)}, got {kind!r}")
        for key in need:
            val = sc.get(key)
            check(isinstance(val, (int, float)) and not isinstance(val, bool) and val > 0,
                  "attention.rope_scaling_params", f"{kind} needs a positive number {key}, got {val!r}")
        if kind == "llama3":
            check(sc["high_freq_factor"] != sc["low_freq_factor"], "attention.rope_scaling_params",
                  "llama3 needs high_freq_factor != low_freq_factor")


_ROPE_KEYS = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                "original_max_position_embeddings"),
              "yarn": ("factor", "original_max_position_embeddings")}


class MoEConfig(Section):
    num_experts: PosInt = 8
    top_k: PosInt = 2
    moe_intermediate_size: PosInt = 128
    shared_expert_intermediate_size: NonNegInt = 0  # 0 = no shared expert
    first_k_dense: NonNegInt = 0  # the first k layers use a dense FFN
    dense_intermediate_size: PosInt = 256
    norm_topk_prob: bool = True
    router_aux_loss_coef: Num(ge=0) = 0.01  # switch load-balancing loss weight
    router_z_loss_coef: Num(ge=0) = 0.001
    moe_dispatch: Literal["sorted", "loop"] = "sorted"  # dropless grouped | reference loop
    shared_expert_gate: bool = False  # shared expert scaled by sigmoid(x W_g) (Qwen2-MoE)

    def check_layout(self) -> None:
        check(self.top_k <= self.num_experts, "moe.top_k",
              f"must be in [1, moe.num_experts={self.num_experts}], got {self.top_k}")
        check(not self.shared_expert_gate or self.shared_expert_intermediate_size > 0, "moe.shared_expert_gate",
              "needs a shared expert (moe.shared_expert_intermediate_size > 0)")


class ChunkingConfig(Section):
    chunking: bool = Field(False, alias="enabled")  # flat name ``chunking``, YAML ``chunking.enabled``
    encoder_layers: NonNegInt = 1  # L_E (token layers before the chunker)
    decoder_layers: NonNegInt = 1  # L_D (token layers after the dechunker); L_C = the rest
    target_ratio: Num(ge=1.0) = 2.0  # R = tokens / concepts
    concept_merge: Literal["last", "sum"] = "last"
    boundary_noise_tau: Num(ge=0) | None = 6.0  # None or 0 = no boundary noise in training
    ratio_loss_weight: Num(ge=0) = 0.03  # lambda
    router_init: Literal["identity", "random"] = "identity"
    boundary_mode: Literal["dynamic", "fixed", "all"] = "dynamic"  # learned | every R tokens | R = 1
    modality_policy: Literal["joint", "split_at_switch"] = "joint"
    image_target_ratio: Num(ge=1.0) | None = None  # per-modality targets (both or neither)
    text_target_ratio: Num(ge=1.0) | None = None
    concept_hidden_size: PosInt | None = None  # d_c; None = hidden_size
    concept_top_k: PosInt | None = None  # top-k in concept layers (strategy 1); None = top_k
    concept_loop_layers: list[NonNegInt] = []  # concept-layer indices re-run
    concept_loop_times: PosInt = 1  # how many times each listed layer runs
    joint_decoding_layers: NonNegInt = 4  # K: last K decoder layers get W^c projections (capped by L_D)

    def check_layout(self, num_hidden_layers: int, num_experts: int) -> None:
        # Values are checked with chunking off too; the layer layout only matters when it is on.
        check((self.image_target_ratio is None) == (self.text_target_ratio is None), "chunking.image_target_ratio",
              "per-modality targets need both chunking.image_target_ratio and chunking.text_target_ratio")
        check(self.concept_top_k is None or self.concept_top_k <= num_experts, "chunking.concept_top_k",
              f"must be in [1, moe.num_experts={num_experts}] (or null), got {self.concept_top_k}")
        if not self.chunking:
            return
        check(self.encoder_layers >= 1, "chunking.encoder_layers", "must be >= 1 when chunking is on")
        check(self.decoder_layers >= 1, "chunking.decoder_layers", "must be >= 1 when chunking is on")
        n_concept = num_hidden_layers - self.encoder_layers - self.decoder_layers
        check(n_concept >= 1, "num_hidden_layers",
              f"{num_hidden_layers} leaves no concept layer after chunking.encoder_layers={self.encoder_layers} "
              f"and chunking.decoder_layers={self.decoder_layers}")
        check(all(i < n_concept for i in self.concept_loop_layers), "chunking.concept_loop_layers",
              f"indices must lie in [0, {n_concept}), got {self.concept_loop_layers}")


class LayoutConfig(Section):
    """Top-level keys (also accepted under ``layout:``); token ids are checked against the vocabulary."""
    vocab_size: PosInt = 2048
    num_hidden_layers: PosInt = 4
    tie_word_embeddings: bool = False
    initializer_range: Num(gt=0) = 0.02
    pad_token_id: Any = 0
    bos_token_id: Any = None
    eos_token_id: Any = None  # an id or a list of ids

    def check_layout(self) -> None:
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            ids = value if isinstance(value, list) and name == "eos_token_id" else [value]
            check(value is None or all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.vocab_size
                                       for i in ids), name,
                  f"must be null or a token id in [0, vocab_size={self.vocab_size}), got {value!r}")


SECTIONS: dict[str, type[Section]] = {"attention": AttentionConfig, "moe": MoEConfig, "chunking": ChunkingConfig,
                                      "layout": LayoutConfig}
# flat field name -> its section ("" = top level); ``chunking`` is the chunking section's ``enabled``
FIELD_OWNER = {name: ("" if sec == "layout" else sec) for sec, cls in SECTIONS.items() for name in cls.model_fields}
_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def field_key(name: str) -> str:
    """A flat field's dotted name as the user writes it: ``top_k`` -> ``moe.top_k``."""
    if name == "chunking":
        return "chunking.enabled"
    return f"{FIELD_OWNER[name]}.{name}" if FIELD_OWNER.get(name) else name


def _sections(values: dict) -> dict[str, Section]:
    """Each section validated from flat field values (missing = the default)."""
    return {sec: build(cls, {info.alias or f: values[f] for f, info in cls.model_fields.items() if f in values},
                       "" if sec == "layout" else f"{sec}.")
            for sec, cls in SECTIONS.items()}


def _flat_name(section: str, key: str) -> str:
    return "chunking" if (section == "chunking" and key == "enabled") else key


class ConceptMoEConfig(PretrainedConfig):
    """The language model: plain MoE (``chunking=False``) or ConceptMoE (``chunking=True``)."""

    model_type = "conceptmoe"

    def __init__(self, runtime: RuntimeOptions | dict | None = None, **kwargs):
        self.runtime = runtime_options(runtime)  # how it computes (runtime.py); not saved (``to_dict``)
        own = {name: kwargs.pop(name) for name in list(kwargs) if name in FIELD_OWNER}
        sections = _sections(own)  # before transformers' own checks see a wrongly typed value
        values = {f: getattr(sec, f) for sec in sections.values() for f in type(sec).model_fields}
        for name, val in values.items():
            if name not in _IDS and name != "tie_word_embeddings":
                setattr(self, name, val)
        super().__init__(**{n: values[n] for n in (*_IDS, "tie_word_embeddings")}, **kwargs)
        self._check_across(sections)

    def _get_generation_parameters(self) -> dict:
        # ``top_k`` is the MoE's experts per token, not a sampling setting: without this,
        # transformers mistakes it for a generation parameter and ``save_pretrained`` raises.
        return {k: v for k, v in super()._get_generation_parameters().items() if k not in FIELD_OWNER}

    def to_dict(self) -> dict:
        out = super().to_dict()
        out.pop("runtime", None)  # a runtime setting of this process, not part of the architecture
        return out

    # component views (built from the live attributes, unvalidated: ``validate`` checks them) ------
    def _view(self, cls: type[Section]) -> Section:
        return cls.model_construct(**{name: getattr(self, name) for name in cls.model_fields})

    @property
    def attention(self) -> AttentionConfig:
        return self._view(AttentionConfig)

    @property
    def moe(self) -> MoEConfig:
        return self._view(MoEConfig)

    @property
    def chunk(self) -> ChunkingConfig:
        return self._view(ChunkingConfig)

    @property
    def concept_layers(self) -> int:
        """L_C: layers between the chunker and the dechunker (0 when chunking is off)."""
        if not self.chunking:
            return 0
        return self.num_hidden_layers - self.encoder_layers - self.decoder_layers

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        """Type- and range-check every section (the live attributes), then the cross-section layout."""
        self._check_across(_sections({name: getattr(self, name) for name in FIELD_OWNER}))

    def _check_across(self, sec: dict[str, Section]) -> None:
        sec["layout"].check_layout()
        sec["attention"].check_layout()
        sec["moe"].check_layout()
        sec["chunking"].check_layout(self.num_hidden_layers, self.num_experts)
        if self.chunking and self.concept_hidden_size:
            check(self.concept_hidden_size % self.num_attention_heads == 0, "chunking.concept_hidden_size",
                  f"{self.concept_hidden_size} is not divisible by attention.num_attention_heads={self.num_attention_heads}")
            c_head = self.head_dim or self.concept_hidden_size // self.num_attention_heads
            check(c_head % 2 == 0, "chunking.concept_hidden_size",
                  f"RoPE needs an even head dimension, got {c_head} in the concept layers")

    # YAML ---------------------------------------------------------------------------------------
    @classmethod
    def known_keys(cls) -> set[str]:
        return set(FIELD_OWNER)

    @classmethod
    def flatten_sections(cls, raw: dict, overrides: dict | None = None) -> dict:
        """Sectioned YAML + flat or dotted overrides -> flat field values (unknown keys named)."""
        flat: dict[str, Any] = {}
        runtime: dict[str, Any] = {}
        for key, val in (raw or {}).items():
            if key == "runtime":
                check(isinstance(val, dict), "runtime", f"must be a mapping, got {val!r}")
                runtime.update(val)
            elif key in SECTIONS and isinstance(val, dict):
                for sub, subval in val.items():
                    name = _flat_name(key, sub)
                    check(name in SECTIONS[key].model_fields, f"{key}.{sub}", "unknown config key")
                    flat[name] = subval
            else:
                check(key in FIELD_OWNER, key, "unknown config key")
                flat[key] = val
        for key, val in (overrides or {}).items():
            section, _, sub = key.rpartition(".")
            if section == "runtime":
                runtime[sub] = val
                continue
            name = _flat_name(section, sub)
            ok = name in FIELD_OWNER and (not section or (section in SECTIONS and name in SECTIONS[section].model_fields))
            check(ok, key, "unknown config key")
            flat[name] = val
        if runtime:
            flat["runtime"] = runtime
        return flat

    @classmethod
    def from_dict_sections(cls, raw: dict, overrides: dict | None = None) -> "ConceptMoEConfig":
        return cls(**cls.flatten_sections(raw, overrides))

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> "ConceptMoEConfig":
        """Load a model preset (optionally wrapped in ``model:``); overrides as in ``from_dict_sections``."""
        raw = load_yaml(path)
        if "model" in raw and isinstance(raw["model"], dict) and len(raw) == 1:
            raw = raw["model"]
        return cls.from_dict_sections(raw, overrides)


ConceptMoEConfig.register_for_auto_class("AutoConfig")  # a saved config carries its code and auto_map

__all__ = ["AttentionConfig", "ChunkingConfig", "ConceptMoEConfig", "ConfigError", "FIELD_OWNER", "LayoutConfig",
           "MoEConfig", "SECTIONS", "field_key", "fail"]
