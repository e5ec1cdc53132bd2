"""The model side of the trainer: tokenizer, model config, model and processor from the ``model``
section. Three starts: a preset (random weights, or ``init_from`` an export of the same
architecture), pretrained parts (``model.llm`` + ``model.vision``; ``assemble.py``), or an export
that brings its own architecture (``preset: null`` + ``init_from``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vlm.config import ConfigError
from vlm.config.train import TrainConfig
from vlm.safe_loading import load_state_dict_checked
from vlm.training import assemble


def _prefix_error(err: Exception) -> ConfigError:
    msg = str(err)
    if msg.startswith("config error: model."):
        return ConfigError(msg)
    if msg.startswith("config error: "):
        return ConfigError("config error: model." + msg[len("config error: "):])
    return ConfigError(f"config error: model: {msg.splitlines()[0] if msg else type(err).__name__}")


def load_tokenizer(path: str | None):
    if not path:
        return None
    if not Path(path).is_dir():
        raise ConfigError(f"config error: model.tokenizer: folder not found: {path} (run `make data`?)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


def token_ids(tokenizer) -> tuple[dict, dict]:
    """Model-config token fields from a tokenizer prepared for our pipeline: vocabulary size, pad, the
    id that ends an assistant turn as eos (generation stops there), and the image tokens."""
    from data_pipelines.chat_template import ChatTokenizer

    chat = ChatTokenizer(tokenizer, num_image_tokens=0)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else chat.pad_id
    eos = chat.end_id if chat.end_id is not None else tokenizer.eos_token_id
    ids = {"vocab_size": len(tokenizer), "pad_token_id": pad, "eos_token_id": eos}
    img = {"image_token_id": chat.image_id, "im_start_token_id": chat.image_start_id,
           "im_end_token_id": chat.image_end_id}
    return ids, img


def synthetic_token_ids(vocab_size: int) -> tuple[dict, dict]:
    return ({"pad_token_id": 0, "eos_token_id": 1},
            {"image_token_id": vocab_size - 1, "im_start_token_id": vocab_size - 2,
             "im_end_token_id": vocab_size - 3})


def build_model_config(cfg: TrainConfig, tokenizer=None, text_base: dict | None = None, vlm_base: dict | None = None):
    """The model config (VLM or LM) from the preset + model overrides + tokenizer ids. With
    ``model.tokenizer`` set, the vocabulary size and the special-token ids come from the tokenizer;
    without one (synthetic data) fixed ids at the top of the preset's vocabulary are used.
    ``text_base``: the language model's fields (a pretrained LLM's, or an export's) instead of the
    preset's; ``vlm_base``: an export's ``vision:`` / ``projector:`` instead of the preset's."""
    from vlm.config import ConceptMoEConfig
    from vlm.config.core import load_yaml
    from vlm.config.vlm import ConceptMoEVLMConfig

    over = dict(cfg.model.overrides)
    try:
        text_ids, img_ids = token_ids(tokenizer) if tokenizer is not None else ({}, {})
        if text_base is not None and text_ids:  # the LLM's vocabulary may already have room (padded rows)
            text_ids["vocab_size"] = max(text_ids["vocab_size"], text_base["vocab_size"])
        if cfg.model.kind == "vlm":
            preset = Path(cfg.model.preset) if cfg.model.preset else None
            raw = vlm_base if vlm_base is not None else load_yaml(preset)
            if text_base is not None and raw.get("text_preset") is not None:
                raise ConfigError(f"config error: model.preset: {preset} names a text_preset, but the language "
                                  "model comes from model.llm: use a preset with vision: and projector: only "
                                  "(configs/model/llava.yaml)")
            if text_base is None and raw.get("text_preset") is None:
                raise ConfigError(f"config error: model.llm: {preset} has no language model (no text_preset): "
                                  "set model.llm=<a transformers or ConceptMoE folder>")
            model_config = ConceptMoEVLMConfig.from_sections(
                raw, {**text_ids, **img_ids, **over}, base_dir=preset.parent if preset else None, text_base=text_base)
            if tokenizer is None:  # ids at the top of the vocabulary the preset (+ overrides) ended with
                text_ids, img_ids = synthetic_token_ids(model_config.text_config.vocab_size)
                for target, ids in ((model_config.text_config, text_ids), (model_config, img_ids)):
                    for name, value in ids.items():
                        if name not in over:
                            setattr(target, name, value)
                    target.validate()
            return model_config
        if text_base is not None:
            return ConceptMoEConfig(**{**text_base, **ConceptMoEConfig.flatten_sections({}, {**text_ids, **over})})
        return ConceptMoEConfig.from_yaml(cfg.model.preset, **{**text_ids, **over})
    except ConfigError as err:
        raise _prefix_error(err) from None
    except (TypeError, ValueError) as err:
        raise _prefix_error(err) from None


def model_class(kind: str):
    if kind == "vlm":
        from vlm.modeling.vlm_model import ConceptMoEVLMForConditionalGeneration

        return ConceptMoEVLMForConditionalGeneration
    from vlm.modeling.hf import ConceptMoEForCausalLM

    return ConceptMoEForCausalLM


def build_model(model_config, kind: str):
    return model_class(kind)(model_config)


def load_export(path: str, model_config, kind: str, say=print):
    """Our export at ``path`` with ``model_config`` (its own + overrides) in fp32, read once (the vision
    tower is built on the meta device, nothing else is read); any key that does not load is one line."""
    import torch

    model, info = model_class(kind).from_pretrained(path, config=model_config, dtype=torch.float32,
                                                    output_loading_info=True)
    tied = model_config.get_text_config().tie_word_embeddings
    problems = {name: [k for k in info.get(name, []) if not (tied and str(k).endswith("lm_head.weight"))]
                for name in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    problems = {name: keys[:3] for name, keys in problems.items() if keys}
    if problems:
        raise ConfigError(f"config error: model.init_from: {path} does not match the configured model ({problems})")
    assemble.log_init_from(model, Path(path), say)
    return model


def init_weights_from(model, path: str, kind: str, say=print) -> None:
    """Copy the weights of an HF export (``save_pretrained`` folder) into ``model`` (strict); one log
    line per part. A foreign checkpoint, a missing / unexpected key or a shape mismatch is one line."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"config error: model.init_from: folder not found: {path} (run the previous stage first?)")
    assemble.check_init_from_type(path, kind)
    if kind == "vlm":
        from vlm.modeling.vlm_model import ConceptMoEVLMForConditionalGeneration as cls
    else:
        from vlm.modeling.hf import ConceptMoEForCausalLM as cls
    source = cls.from_pretrained(path).state_dict()
    bad = assemble.shape_mismatches(source, model.state_dict())
    if bad:
        raise ConfigError(f"config error: model.init_from: {path} does not match the model (shapes {bad[:3]})")
    missing, unexpected = load_state_dict_checked(model, source)
    if missing or unexpected:
        raise ConfigError(f"config error: model.init_from: {path} does not match the model "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    assemble.log_init_from(model, path, say)


def text_config_of(model_config):
    return getattr(model_config, "text_config", model_config)


def build_processor(model, tokenizer):
    """``ConceptMoEVLMProcessor`` for a VLM (image settings from its vision tower); None otherwise."""
    if tokenizer is None or not hasattr(model, "vision"):
        return None
    from vlm.processing import ConceptMoEVLMProcessor

    return ConceptMoEVLMProcessor.for_model(tokenizer, model)


@dataclass
class ModelSetup:
    tokenizer: object
    model_config: object
    model: object


def _export_bases(path: Path, kind: str) -> tuple[dict, dict | None]:
    """(text fields, vision/projector sections) of our export at ``path``."""
    from transformers import AutoConfig

    assemble.check_init_from_type(path, kind)
    config = AutoConfig.from_pretrained(str(path))
    if kind == "vlm":
        return assemble.field_values(config.text_config), {"vision": config.vision, "projector": config.projector}
    return assemble.field_values(config), None


def setup_model(cfg: TrainConfig, say=print) -> ModelSetup:
    """Tokenizer, model config and model with its starting weights, every part logged."""
    m = cfg.model
    llm, text_base, vlm_base, tok_path = None, None, None, m.tokenizer
    if m.llm:
        llm = assemble.read_llm(m.llm)
        text_base, tok_path = assemble.field_values(llm.config), tok_path or m.llm
    elif m.preset is None:
        text_base, vlm_base = _export_bases(Path(m.init_from), m.kind)
        tok_path = tok_path or m.init_from
    if llm is not None or m.preset is None:
        tokenizer, added, n_original = assemble.load_tokenizer_prepared(tok_path)
        if added:
            say(f"[model] tokenizer {tok_path}: added {', '.join(added)} (ids {len(tokenizer) - len(added)}.."
                f"{len(tokenizer) - 1})")
    else:
        tokenizer, added, n_original = load_tokenizer(tok_path), [], 0
    model_config = build_model_config(cfg, tokenizer, text_base, vlm_base)
    if m.preset is None and llm is None:
        return ModelSetup(tokenizer, model_config, load_export(m.init_from, model_config, m.kind, say))
    model = build_model(model_config, m.kind)
    if llm is not None:
        new_ids = tokenizer.convert_tokens_to_ids(added) if added else []
        assemble.load_llm_into(model, llm, new_ids, n_original, say)
        assemble.log_new_parts(model, say)
    if m.init_from:
        init_weights_from(model, m.init_from, m.kind, say)
    elif llm is None:
        from vision_encoders.hub import weights_digest

        count, digest = weights_digest(getattr(model, "language_model", model))
        say(f"[model] language model: random init from the preset {m.preset} (no model.llm / init_from): "
            f"{count} tensors, {digest}")
        assemble.log_new_parts(model, say)
    return ModelSetup(tokenizer, model_config, model)
