"""``ConceptMoEVLMConfig``: vision encoder + projector + the ConceptMoE language model.

YAML (``configs/model/vlm_tiny.yaml``): ``vision:``, ``projector:``, ``text_preset:`` (a language-model
preset, relative to the file) and ``text:`` (keys that override it). Overrides: ``vision.backbone=...``,
``projector.merge=...``; any other key goes to the language model. Token ids come from the tokenizer."""
from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from .config_base import build, check, load_yaml
from .configuration_conceptmoe import SECTIONS, ConceptMoEConfig
from .projector import ProjectorConfig
from .vision_base import VisionEncoderConfig
from .vision_registry import VISION_BACKBONES

TOKEN_FIELDS = ("image_token_id", "im_start_token_id", "im_end_token_id")


def _mapping(value, key: str) -> dict:
    """A config section: a mapping (null = empty); anything else is a one-line error naming it."""
    if value is None:
        return {}
    check(isinstance(value, dict), key, f"must be a mapping of keys to values, got {value!r}")
    return dict(value)


def _check_vision(vision) -> None:
    """What the section itself does not check: a registered backbone."""
    check(vision.backbone in VISION_BACKBONES, "vision.backbone",
          f"unknown backbone {vision.backbone!r} (known: {', '.join(sorted(VISION_BACKBONES))})")


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
        self.validate()

    def validate(self) -> None:
        _check_vision(self.vision_config)
        self.projector_config  # noqa: B018 - builds (and so checks) the projector section
        vocab = self.text_config.vocab_size
        for name in TOKEN_FIELDS:
            value = getattr(self, name)
            check(value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab),
                  name, f"must be null or a token id in [0, vocab_size={vocab}), got {value!r}")

    @property
    def vision_config(self):
        return build(VisionEncoderConfig, self.vision, "vision.")

    @property
    def projector_config(self):
        return build(ProjectorConfig, self.projector, "projector.")

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> "ConceptMoEVLMConfig":
        path = Path(path)
        return cls.from_sections(load_yaml(path), overrides, base_dir=path.parent)

    @classmethod
    def from_sections(cls, raw: dict, overrides: dict | None = None, base_dir: Path | None = None,
                      text_base: dict | None = None):
        """The YAML sections + overrides (``vision.x``, ``projector.x``, ``text.x`` or a model key).
        ``text_base``: flat language-model fields (a pretrained LLM's) used instead of ``text_preset``."""
        allowed = {"vision", "projector", "text_preset", "text", *TOKEN_FIELDS}
        for key in raw:
            check(key in allowed, key, f"unknown config key (expected one of {sorted(allowed)})")
        vision, projector = _mapping(raw.get("vision"), "vision"), _mapping(raw.get("projector"), "projector")
        text_raw = dict(text_base) if text_base is not None else \
            _text_preset(raw.get("text_preset"), base_dir) if raw.get("text_preset") is not None else {}
        text_over = dict(_flat_text(_mapping(raw.get("text"), "text")))
        tokens = {k: raw[k] for k in TOKEN_FIELDS if k in raw}
        for key, val in (overrides or {}).items():
            head, _, rest = key.partition(".")
            if head in ("vision", "projector", "text") and rest:
                {"vision": vision, "projector": projector, "text": text_over}[head][rest] = val
            elif key in TOKEN_FIELDS:
                tokens[key] = val
            else:
                text_over[key] = val
        text = ConceptMoEConfig.from_dict_sections(text_raw, text_over)
        return cls(vision=vision, projector=projector, text_config=text, **tokens)


def _text_preset(value, base_dir: Path | None) -> dict:
    check(isinstance(value, str) and bool(value), "text_preset",
          f"must be the path of a language-model preset, got {value!r}")
    preset = Path(value)
    if not preset.is_absolute() and base_dir is not None and (base_dir / preset).exists():
        preset = base_dir / preset
    check(preset.is_file(), "text_preset", f"file not found: {preset}")
    return load_yaml(preset)


def _flat_text(section: dict):
    """``{chunking: {modality_policy: x}}`` -> ``("chunking.modality_policy", x)``; only the model
    config's sections are opened (a mapping under a plain key is passed on and named by its check)."""
    for key, val in section.items():
        if isinstance(val, dict) and key in SECTIONS:
            for sub, subval in val.items():
                yield f"{key}.{sub}", subval
        else:
            yield key, val


AutoConfig.register("conceptmoe_vlm", ConceptMoEVLMConfig, exist_ok=True)
ConceptMoEVLMConfig.register_for_auto_class("AutoConfig")  # a saved config carries its code and auto_map
