"""``ConceptMoEVLMConfig``: vision encoder + projector + the ConceptMoE language model.

YAML layout (``configs/model/vlm_tiny.yaml``)::

    vision:    {backbone: tiny-vit, pretrained: null, feature_layer: last}
    projector: {kind: mlp2x_gelu, merge: none}
    text_preset: tiny_concept.yaml     # a language-model preset (path relative to this file) ...
    text: {chunking: {modality_policy: joint}}   # ... and/or keys that override it

Overrides: ``vision.backbone=small-vit``, ``projector.merge=pixel_shuffle2x2``; any other key goes
to the language model (``num_experts=16``, ``chunking.modality_policy=split_at_switch``,
``text.top_k=4``). Token ids (``image_token_id`` ...) come from the tokenizer and are set by the
processor / trainer; the vocabulary size follows the tokenizer too.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from vision_encoders import VISION_BACKBONES, ProjectorConfig, VisionEncoderConfig
from vision_encoders.base import HUB_PREFIXES
from vlm.config import _SECTIONS as _TEXT_SECTIONS
from vlm.config import ConceptMoEConfig, ConfigError, load_yaml

_TOKEN_FIELDS = ("image_token_id", "im_start_token_id", "im_end_token_id")


def _err(key: str, msg: str) -> ConfigError:
    return ConfigError(f"config error: {key}: {msg}")


def _mapping(value, key: str) -> dict:
    """A config section: a mapping (null = empty); anything else is a one-line error naming it."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _err(key, f"must be a mapping of keys to values, got {value!r}")
    return dict(value)


def _dataclass_from(cls, raw: dict, section: str):
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    for key in raw:
        if key not in names:
            raise ConfigError(f"config error: {section}.{key}: unknown config key")
    for f in fields:
        if f.name not in raw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise _err(f"{section}.{f.name}", "is required")
    try:
        return cls(**raw)
    except (TypeError, ValueError) as err:
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"config error: {msg if msg.startswith(section + '.') else f'{section}: {msg}'}") from None


def _check_vision(vision: VisionEncoderConfig) -> None:
    """What the dataclass itself does not check: a registered backbone, a local model name."""
    if vision.backbone not in VISION_BACKBONES:
        raise _err("vision.backbone", f"unknown backbone {vision.backbone!r} (known: {', '.join(sorted(VISION_BACKBONES))})")
    if vision.model_name is not None and vision.model_name.startswith(HUB_PREFIXES):
        raise _err("vision.model_name", f"must be a library model name, not a hub reference, got {vision.model_name!r}")


class ConceptMoEVLMConfig(PretrainedConfig):
    model_type = "conceptmoe_vlm"
    sub_configs = {"text_config": ConceptMoEConfig}

    def __init__(self, vision: dict | None = None, projector: dict | None = None, text_config=None,
                 image_token_id: int | None = None, im_start_token_id: int | None = None,
                 im_end_token_id: int | None = None, **kwargs):
        self.vision = _mapping(vision, "vision") or {"backbone": "tiny-vit"}
        self.projector = _mapping(projector, "projector")
        if text_config is None:
            text_config = ConceptMoEConfig()
        elif isinstance(text_config, dict):
            text_config = ConceptMoEConfig(**{k: v for k, v in text_config.items()
                                              if k not in ("model_type", "transformers_version")})
        self.text_config = text_config
        self.image_token_id = image_token_id
        self.im_start_token_id = im_start_token_id
        self.im_end_token_id = im_end_token_id
        super().__init__(**kwargs)
        _check_vision(self.vision_config)  # validate early: one clear line on a bad value
        self.projector_config
        vocab = text_config.vocab_size
        for name in _TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab):
                raise _err(name, f"must be null or a token id in [0, vocab_size={vocab}), got {value!r}")

    @property
    def vision_config(self) -> VisionEncoderConfig:
        return _dataclass_from(VisionEncoderConfig, self.vision, "vision")

    @property
    def projector_config(self) -> ProjectorConfig:
        return _dataclass_from(ProjectorConfig, self.projector, "projector")

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> "ConceptMoEVLMConfig":
        path = Path(path)
        raw = load_yaml(path)
        return cls.from_sections(raw, overrides, base_dir=path.parent)

    @classmethod
    def from_sections(cls, raw: dict, overrides: dict | None = None, base_dir: Path | None = None):
        raw = dict(raw)
        allowed = {"vision", "projector", "text_preset", "text", *_TOKEN_FIELDS}
        for key in raw:
            if key not in allowed:
                raise ConfigError(f"config error: {key}: unknown config key (expected one of {sorted(allowed)})")
        vision, projector = _mapping(raw.get("vision"), "vision"), _mapping(raw.get("projector"), "projector")
        text_raw: dict = {}
        if raw.get("text_preset") is not None:
            if not isinstance(raw["text_preset"], str) or not raw["text_preset"]:
                raise _err("text_preset", f"must be the path of a language-model preset, got {raw['text_preset']!r}")
            preset = Path(raw["text_preset"])
            if not preset.is_absolute() and base_dir is not None and (base_dir / preset).exists():
                preset = base_dir / preset
            if not preset.is_file():
                raise _err("text_preset", f"file not found: {preset}")
            text_raw = load_yaml(preset)
        text_over = dict(_flat_text(_mapping(raw.get("text"), "text")))
        tokens = {k: raw[k] for k in _TOKEN_FIELDS if k in raw}
        for key, val in (overrides or {}).items():
            head, _, rest = key.partition(".")
            if head == "vision" and rest:
                vision[rest] = val
            elif head == "projector" and rest:
                projector[rest] = val
            elif head == "text" and rest:
                text_over[rest] = val
            elif key in _TOKEN_FIELDS:
                tokens[key] = val
            else:
                text_over[key] = val
        text = ConceptMoEConfig.from_dict_sections(text_raw, text_over)
        return cls(vision=vision, projector=projector, text_config=text, **tokens)


def _flat_text(section: dict, prefix: str = ""):
    """``{chunking: {modality_policy: x}}`` -> ``("chunking.modality_policy", x)`` pairs. Only the
    model config's sections are opened: a mapping given to a plain key (``vocab_size: {}``) is
    passed on as it is and named by the model config's type check."""
    for key, val in section.items():
        if isinstance(val, dict) and key in _TEXT_SECTIONS:
            for sub, subval in val.items():
                yield f"{key}.{sub}", subval
        else:
            yield key, val


AutoConfig.register("conceptmoe_vlm", ConceptMoEVLMConfig, exist_ok=True)
