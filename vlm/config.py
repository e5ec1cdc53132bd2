"""Configs: one dataclass per component, the HF model config that bundles them, YAML + overrides.

The language model's config is a flat Hugging Face `PretrainedConfig` (``ConceptMoEConfig``), so
checkpoints are plain ``config.json`` files. Its fields are declared once, grouped by component in
the dataclasses below (``AttentionConfig``, ``MoEConfig``, ``ChunkingConfig``); modules receive
the component view they need (``cfg.attention``, ``cfg.moe``, ``cfg.chunk``).

YAML files may be flat or sectioned (``attention:``, ``moe:``, ``chunking:``, ``layout:``); a
section's keys are flattened, and ``chunking: {enabled: true, ...}`` sets the boolean ``chunking``.
Overrides use the same dotted names: ``num_experts=16``, ``moe.num_experts=16`` or
``chunking.modality_policy=split_at_switch``. Unknown keys and impossible values raise
``ConfigError`` with one line naming the key.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml
from transformers import PretrainedConfig


class ConfigError(ValueError):
    """A bad config key or value; the message is one line naming the key (control characters in a
    user's key or value, e.g. a newline, are shown escaped so that it stays one line)."""

    def __init__(self, message: str = ""):
        super().__init__("".join(c if c.isprintable() else repr(c)[1:-1] for c in str(message)))


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"config error: {_dotted(key)}: {msg}")


def _dotted(key: str) -> str:
    """A field's name as the user writes it in a sectioned YAML: ``top_k`` -> ``moe.top_k``."""
    if key == "chunking":
        return "chunking.enabled"
    owner = globals().get("FIELD_OWNER", {}).get(key)
    return f"{owner}.{key}" if owner else key


def _finite(value) -> bool:
    """A real number that is not NaN or +-inf (an int too large for a float is not)."""
    try:
        return math.isfinite(value)
    except (OverflowError, TypeError):
        return False


def _number(key: str, value, low: float, low_inclusive: bool = True, nullable: bool = False) -> None:
    """``value`` is finite and >= low (> low when not low_inclusive); None only when nullable."""
    if value is None and nullable:
        return
    ok = _finite(value) and (value >= low if low_inclusive else value > low)
    bound = f">= {low}" if low_inclusive else f"> {low}"
    _check(ok, key, f"must be a finite number {bound}{' (or null)' if nullable else ''}, got {value!r}")


@dataclass
class AttentionConfig:
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None  # default hidden_size // num_attention_heads
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6

    def validate(self) -> None:
        _check(self.hidden_size > 0, "hidden_size", f"must be > 0, got {self.hidden_size}")
        _check(self.num_attention_heads > 0, "num_attention_heads", "must be > 0")
        _check(self.hidden_size % self.num_attention_heads == 0, "hidden_size",
               f"{self.hidden_size} is not divisible by attention.num_attention_heads={self.num_attention_heads}")
        _check(self.num_key_value_heads > 0 and self.num_attention_heads % self.num_key_value_heads == 0,
               "num_key_value_heads", f"{self.num_key_value_heads} must divide attention.num_attention_heads="
               f"{self.num_attention_heads}")
        _check(self.head_dim is None or self.head_dim > 0, "head_dim", "must be > 0")
        head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        _check(head_dim % 2 == 0, "head_dim" if self.head_dim else "hidden_size",
               f"RoPE needs an even head dimension, got {head_dim}" + ("" if self.head_dim else
               f" (attention.hidden_size={self.hidden_size} / attention.num_attention_heads={self.num_attention_heads})"))
        _number("rope_theta", self.rope_theta, 0, low_inclusive=False)
        _check(self.max_position_embeddings > 0, "max_position_embeddings", "must be > 0")
        _number("rms_norm_eps", self.rms_norm_eps, 0, low_inclusive=False)


@dataclass
class MoEConfig:
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 128
    shared_expert_intermediate_size: int = 0  # 0 = no shared expert
    first_k_dense: int = 0  # the first k layers use a dense FFN
    dense_intermediate_size: int = 256
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.01  # switch load-balancing loss weight
    router_z_loss_coef: float = 0.001
    moe_dispatch: str = "sorted"  # "sorted" (dropless grouped) | "loop" (reference)

    def validate(self) -> None:
        _check(self.num_experts >= 1, "num_experts", f"must be >= 1, got {self.num_experts}")
        _check(1 <= self.top_k <= self.num_experts, "top_k",
               f"must be in [1, moe.num_experts={self.num_experts}], got {self.top_k}")
        _check(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be > 0")
        _check(self.shared_expert_intermediate_size >= 0, "shared_expert_intermediate_size", "must be >= 0")
        _check(self.first_k_dense >= 0, "first_k_dense", "must be >= 0")
        _check(self.dense_intermediate_size > 0, "dense_intermediate_size", "must be > 0")
        _number("router_aux_loss_coef", self.router_aux_loss_coef, 0)
        _number("router_z_loss_coef", self.router_z_loss_coef, 0)
        _check(self.moe_dispatch in ("sorted", "loop"), "moe_dispatch",
               f"must be 'sorted' or 'loop', got {self.moe_dispatch!r}")


@dataclass
class ChunkingConfig:
    chunking: bool = False
    encoder_layers: int = 1  # L_E (token layers before the chunker)
    decoder_layers: int = 1  # L_D (token layers after the dechunker); L_C = the rest
    target_ratio: float = 2.0  # R = tokens / concepts
    concept_merge: str = "last"  # "last" | "sum"
    boundary_noise_tau: float | None = 6.0  # None or 0 = no boundary noise in training
    ratio_loss_weight: float = 0.03  # lambda
    router_init: str = "identity"  # "identity" | "random"
    boundary_mode: str = "dynamic"  # "dynamic" (learned) | "fixed" (every R tokens) | "all" (R=1)
    modality_policy: str = "joint"  # "joint" | "split_at_switch"
    image_target_ratio: float | None = None  # per-modality targets (both or neither)
    text_target_ratio: float | None = None
    concept_hidden_size: int | None = None  # d_c; None = hidden_size
    concept_top_k: int | None = None  # top-k in concept layers (strategy 1); None = top_k
    concept_loop_layers: list = field(default_factory=list)  # concept-layer indices re-run
    concept_loop_times: int = 1  # how many times each listed layer runs (>= 1)
    joint_decoding_layers: int = 4  # K: last K decoder layers get W^c projections (capped by L_D)

    def validate(self, num_hidden_layers: int, num_experts: int) -> None:
        # Values are checked even with chunking off (a typo in a plain preset must not wait until
        # the model is converted); the layer layout only matters when chunking is on.
        _check(_finite(self.target_ratio) and self.target_ratio >= 1.0, "target_ratio",
               f"ratio R must be a finite number >= 1, got {self.target_ratio}")
        _check(self.concept_merge in ("last", "sum"), "concept_merge",
               f"must be 'last' or 'sum', got {self.concept_merge!r}")
        _check(self.boundary_noise_tau is None or (_finite(self.boundary_noise_tau) and self.boundary_noise_tau >= 0),
               "boundary_noise_tau", f"must be a finite number >= 0 (0 or null switches boundary noise off), "
               f"got {self.boundary_noise_tau!r}")
        _number("ratio_loss_weight", self.ratio_loss_weight, 0)
        _check(self.router_init in ("identity", "random"), "router_init",
               f"must be 'identity' or 'random', got {self.router_init!r}")
        _check(self.boundary_mode in ("dynamic", "fixed", "all"), "boundary_mode",
               f"must be 'dynamic', 'fixed' or 'all', got {self.boundary_mode!r}")
        _check(self.modality_policy in ("joint", "split_at_switch"), "modality_policy",
               f"must be 'joint' or 'split_at_switch', got {self.modality_policy!r}")
        _check((self.image_target_ratio is None) == (self.text_target_ratio is None), "image_target_ratio",
               "per-modality targets need both chunking.image_target_ratio and chunking.text_target_ratio")
        for key in ("image_target_ratio", "text_target_ratio"):
            val = getattr(self, key)
            _check(val is None or (_finite(val) and val >= 1.0), key, f"ratio R must be a finite number >= 1, got {val}")
        # counts and ids: impossible whatever the layout
        _check(self.encoder_layers >= 0, "encoder_layers", f"must be >= 0, got {self.encoder_layers}")
        _check(self.decoder_layers >= 0, "decoder_layers", f"must be >= 0, got {self.decoder_layers}")
        _check(self.concept_hidden_size is None or self.concept_hidden_size > 0, "concept_hidden_size",
               f"must be > 0 (or null), got {self.concept_hidden_size}")
        _check(self.concept_top_k is None or 1 <= self.concept_top_k <= num_experts, "concept_top_k",
               f"must be in [1, moe.num_experts={num_experts}] (or null), got {self.concept_top_k}")
        _check(all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.concept_loop_layers),
               "concept_loop_layers", f"must be a list of layer indices >= 0, got {self.concept_loop_layers!r}")
        _check(self.concept_loop_times >= 1, "concept_loop_times", f"must be >= 1, got {self.concept_loop_times}")
        _check(self.joint_decoding_layers >= 0, "joint_decoding_layers", f"must be >= 0, got {self.joint_decoding_layers}")
        if not self.chunking:
            return
        _check(self.encoder_layers >= 1, "encoder_layers", "must be >= 1 when chunking is on")
        _check(self.decoder_layers >= 1, "decoder_layers", "must be >= 1 when chunking is on")
        n_concept = num_hidden_layers - self.encoder_layers - self.decoder_layers
        _check(n_concept >= 1, "num_hidden_layers",
               f"{num_hidden_layers} leaves no concept layer after chunking.encoder_layers={self.encoder_layers} "
               f"and chunking.decoder_layers={self.decoder_layers}")
        _check(all(i < n_concept for i in self.concept_loop_layers),
               "concept_loop_layers", f"indices must lie in [0, {n_concept}), got {self.concept_loop_layers}")


_COMPONENTS = {"attention": AttentionConfig, "moe": MoEConfig, "chunking": ChunkingConfig}
_LM_TOP = {"vocab_size": 2048, "num_hidden_layers": 4, "tie_word_embeddings": False,
           "initializer_range": 0.02, "pad_token_id": 0, "bos_token_id": None, "eos_token_id": None}
_SECTIONS = set(_COMPONENTS) | {"layout"}
FIELD_OWNER = {f.name: comp for comp, cls in _COMPONENTS.items() for f in fields(cls)}
# Declared type of every field: (base type name, may be null). Annotations are strings here
# (``from __future__ import annotations``), e.g. "int", "float | None", "list".
FIELD_TYPES = {f.name: (str(f.type).split("|")[0].strip(), "None" in str(f.type))
               for cls in _COMPONENTS.values() for f in fields(cls)}
FIELD_TYPES.update({name: (type(val).__name__, False) for name, val in _LM_TOP.items() if val is not None})


def flatten_sections(raw: dict, known: set[str], prefix: str = "") -> dict:
    """Flatten ``{section: {key: v}}`` into ``{key: v}``; ``chunking.enabled`` -> ``chunking``."""
    flat: dict[str, Any] = {}
    for key, val in raw.items():
        if isinstance(val, dict) and key in _SECTIONS:
            for sub, subval in val.items():
                name = "chunking" if (key == "chunking" and sub == "enabled") else sub
                _check(name in known, f"{prefix}{key}.{sub}", "unknown config key")
                flat[name] = subval
        else:
            _check(key in known, f"{prefix}{key}", "unknown config key")
            flat[key] = val
    return flat


def parse_override(text: str) -> tuple[str, Any]:
    """``"moe.num_experts=16"`` -> (``"moe.num_experts"``, 16); values are parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"config error: override {text!r} must look like key=value")
    key, val = text.split("=", 1)
    return key.strip(), yaml.safe_load(val)


def apply_overrides(flat: dict, overrides: dict, known: set[str]) -> dict:
    out = dict(flat)
    for key, val in overrides.items():
        parts = key.split(".")
        if len(parts) == 2 and parts[0] == "chunking" and parts[1] == "enabled":
            name = "chunking"
        else:
            name = parts[-1]
        _check(len(parts) <= 2 and name in known and (len(parts) == 1 or parts[0] in _SECTIONS), key,
               "unknown config key")
        out[name] = val
    return out


def _typecheck(name: str, value: Any) -> None:
    """Check ``value`` against the field's declared type (the default alone said nothing for
    ``int | None`` fields, and a null slipped through everywhere, failing later with a TypeError)."""
    kind, nullable = FIELD_TYPES[name]
    if value is None:
        _check(nullable, name, "must not be null")
        return
    if kind == "bool":
        _check(isinstance(value, bool), name, f"must be true/false, got {value!r}")
    elif kind == "int":
        _check(isinstance(value, int) and not isinstance(value, bool), name, f"must be an integer, got {value!r}")
    elif kind == "float":
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), name,
               f"must be a number, got {value!r}")
    elif kind == "str":
        _check(isinstance(value, str), name, f"must be a string, got {value!r}")
    elif kind == "list":
        _check(isinstance(value, list), name, f"must be a list, got {value!r}")


class ConceptMoEConfig(PretrainedConfig):
    """The language model: plain MoE (``chunking=False``) or ConceptMoE (``chunking=True``)."""

    model_type = "conceptmoe"

    def __init__(self, **kwargs):
        own = {}
        for comp_cls in _COMPONENTS.values():
            for f in fields(comp_cls):
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                val = kwargs.pop(f.name, default)
                _typecheck(f.name, val)
                own[f.name] = val
        for name, default in _LM_TOP.items():
            val = kwargs.pop(name, default)
            if name not in ("pad_token_id", "bos_token_id", "eos_token_id"):
                _typecheck(name, val)
            own[name] = val
        for name, val in own.items():
            if name not in ("pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings"):
                setattr(self, name, val)
        super().__init__(pad_token_id=own["pad_token_id"], bos_token_id=own["bos_token_id"],
                         eos_token_id=own["eos_token_id"], tie_word_embeddings=own["tie_word_embeddings"],
                         **kwargs)
        self.validate()

    def _get_generation_parameters(self) -> dict:
        # ``top_k`` is the MoE's experts per token, not a sampling setting: without this,
        # transformers mistakes it for a generation parameter and ``save_pretrained`` raises.
        return {k: v for k, v in super()._get_generation_parameters().items() if k not in self.known_keys()}

    # component views --------------------------------------------------------------------------
    def _view(self, cls):
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls)})

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
        _check(self.vocab_size > 0, "vocab_size", "must be > 0")
        _check(self.num_hidden_layers >= 1, "num_hidden_layers", "must be >= 1")
        _number("initializer_range", self.initializer_range, 0, low_inclusive=False)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name, None)
            ids = value if isinstance(value, list) and name == "eos_token_id" else [value]
            _check(value is None or all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.vocab_size
                                        for i in ids), name,
                   f"must be null or a token id in [0, vocab_size={self.vocab_size}), got {value!r}")
        self.attention.validate()
        self.moe.validate()
        self.chunk.validate(self.num_hidden_layers, self.num_experts)
        if self.chunking and self.concept_hidden_size:
            _check(self.concept_hidden_size % self.num_attention_heads == 0, "concept_hidden_size",
                   f"{self.concept_hidden_size} is not divisible by attention.num_attention_heads={self.num_attention_heads}")
            c_head = self.head_dim or self.concept_hidden_size // self.num_attention_heads
            _check(c_head % 2 == 0, "concept_hidden_size",
                   f"RoPE needs an even head dimension, got {c_head} in the concept layers")

    # YAML ---------------------------------------------------------------------------------------
    @classmethod
    def known_keys(cls) -> set[str]:
        return set(FIELD_OWNER) | set(_LM_TOP) | {"chunking"}

    @classmethod
    def from_dict_sections(cls, raw: dict, overrides: dict | None = None) -> "ConceptMoEConfig":
        known = cls.known_keys()
        flat = flatten_sections(raw or {}, known)
        flat = apply_overrides(flat, overrides or {}, known)
        return cls(**flat)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> "ConceptMoEConfig":
        """Load a model preset; overrides are ``key=value`` pairs (dots allowed via a dict)."""
        raw = load_yaml(path)
        if "model" in raw and isinstance(raw["model"], dict) and len(raw) == 1:
            raw = raw["model"]
        return cls.from_dict_sections(raw, overrides)


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config error: file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"config error: {path} is not valid YAML: {str(err).splitlines()[0]}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config error: {path} must hold a mapping at top level")
    return raw
