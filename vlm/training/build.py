"""The model side of the trainer: tokenizer, model config, model and processor from the ``model``
section (``setup_model``). Three starts, each part logging one line:

- a preset: random weights, or ``init_from`` an export of the same architecture;
- pretrained parts: ``model.llm`` names the language model, a transformers checkpoint (imported by
  ``vlm.hf_import``) or a ConceptMoE folder (``python -m vlm.convert`` output), with its own tokenizer
  made ready for images (``data_pipelines.llm_tokenizer``); the vision tower is the one ``model.vision``
  names (``vision_encoders``); the projector is new. New token rows (``<image>``, ``<im_start>``,
  ``<im_end>``, a pad or role tokens the LLM lacks) start as the mean of the LLM's own token rows, in
  the input embeddings and the LM head;
- an export that brings its own architecture: ``preset: null`` + ``init_from``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vlm.modeling.config_base import ConfigError
from vlm.modeling.config_base import fail
from vlm.modeling.configuration_conceptmoe import FIELD_OWNER, ConceptMoEConfig
from vlm.config.train import TrainConfig
from vlm.modeling.safe_loading import load_state_dict_checked, read_json, require_safetensors


def _prefix_error(err: Exception) -> ConfigError:
    msg = str(err)
    if msg.startswith("config error: model."):
        return ConfigError(msg)
    if msg.startswith("config error: "):
        return ConfigError("config error: model." + msg[len("config error: "):])
    return ConfigError(f"config error: model: {msg.splitlines()[0] if msg else type(err).__name__}")


# --- pretrained parts (model.llm) and exports (init_from) -------------------------------------
EMBEDDING_KEYS = ("model.embed_tokens.weight", "lm_head.weight")
OWN_TYPES = {"lm": "conceptmoe", "vlm": "conceptmoe_vlm"}


@dataclass
class LLMWeights:
    """A language model read from disk, in our parameter names, before it has a home."""
    path: Path
    what: str  # "olmoe checkpoint, imported" | "ConceptMoE checkpoint"
    config: ConceptMoEConfig
    state_dict: dict[str, torch.Tensor]


def model_type_of(path: Path, key: str) -> str:
    """The ``model_type`` of a checkpoint folder, or a one-line error naming ``key``."""
    if not path.is_dir():
        raise fail(key, f"folder not found: {path}")
    if not (path / "config.json").is_file():
        raise fail(key, f"{path} has no config.json: not a checkpoint folder")
    return str(read_json(path / "config.json").get("model_type", ""))


def read_llm(path_str: str, key: str = "model.llm") -> LLMWeights:
    """The language model at ``path_str``, or one line naming what is wrong with it."""
    from vlm.hf_import import FAMILIES, hf_family, imported_config, load_hf_config, map_weights
    from vlm.hf_import.weights import read_safetensors

    path = Path(path_str)
    kind = model_type_of(path, key)
    try:
        if hf_family(path) is not None:
            require_safetensors(path)
            config = imported_config(load_hf_config(path))
            sd = map_weights(read_safetensors(path), config.tie_word_embeddings)
            return LLMWeights(path, f"{kind} checkpoint, imported", config, sd)
        if kind == "conceptmoe":
            require_safetensors(path)
            config = ConceptMoEConfig.from_pretrained(path)
            return LLMWeights(path, "ConceptMoE checkpoint", config, read_safetensors(path))
    except ConfigError:
        raise
    except (ValueError, OSError) as err:
        raise fail(key, f"{path}: {(str(err).splitlines() or [type(err).__name__])[0]}") from None
    if kind == "conceptmoe_vlm":
        raise fail(key, f"{path} is a ConceptMoE VLM export: continue from it with model.init_from "
                        "(and model.preset: null)")
    raise fail(key, f"{path} is a {kind!r} checkpoint: expected a transformers LLM of the families "
                    f"{', '.join(FAMILIES)} or a ConceptMoE checkpoint (python -m vlm.convert)")


def field_values(config: ConceptMoEConfig) -> dict:
    """The model fields of a language-model config (what a preset would say), flat."""
    return {name: getattr(config, name) for name in FIELD_OWNER}


def load_tokenizer_prepared(path: str):
    """The tokenizer at ``path`` made ready for images; returns (tokenizer, added tokens, original size)."""
    from data_pipelines.llm_tokenizer import prepare_llm_tokenizer
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise fail("model.tokenizer", f"folder not found: {path}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise fail("model.tokenizer", f"{path}: no usable tokenizer ({(str(err).splitlines() or [''])[0]})") from None
    original = len(tokenizer)
    return tokenizer, prepare_llm_tokenizer(tokenizer), original


def grow_embeddings(sd: dict, vocab_size: int, new_ids: list[int], n_original: int) -> None:
    """Pad the embedding (and untied head) rows of ``sd`` to ``vocab_size``; rows ``new_ids`` = the mean
    of the first ``n_original`` rows (the LLM's own tokens)."""
    for key in EMBEDDING_KEYS:
        if key not in sd:
            continue
        weight = sd[key]
        if weight.shape[0] < vocab_size:
            weight = torch.cat([weight, weight.new_zeros(vocab_size - weight.shape[0], weight.shape[1])])
        if new_ids:
            weight = weight.clone()
            weight[new_ids] = weight[:n_original].float().mean(0).to(weight.dtype)
        sd[key] = weight


def shape_mismatches(source: dict, expected: dict) -> list[str]:
    """``"name (source shape) vs (expected shape)"`` for every tensor both hold with different shapes."""
    return [f"{k} {tuple(v.shape)} vs {tuple(expected[k].shape)}" for k, v in source.items()
            if k in expected and v.shape != expected[k].shape]


def load_llm_into(model, llm: LLMWeights, new_ids: list[int], n_original: int, log_line) -> None:
    """Copy ``llm`` into the model's language model (strict); one log line."""
    from vlm.modeling.vision_hub import weights_digest

    target = getattr(model, "language_model", model)
    vocab = target.config.vocab_size
    grow_embeddings(llm.state_dict, vocab, new_ids, n_original)
    bad = shape_mismatches(llm.state_dict, target.state_dict())
    if bad:
        raise fail("model.llm", f"{llm.path}: shape mismatch with the configured model: {bad[:3]}")
    missing, unexpected = load_state_dict_checked(target, llm.state_dict)
    if missing or unexpected:
        raise fail("model.llm", f"{llm.path} does not match the configured model (missing {missing[:3]}, "
                                f"unexpected {unexpected[:3]})")
    count, digest = weights_digest(target)
    added = f"; {len(new_ids)} new token rows = mean of {n_original}" if new_ids else ""
    log_line(f"[model] language model <- {llm.path} ({llm.what}): {count} tensors, {digest}{added}")


def log_new_parts(model, log_line) -> None:
    """One line for each part that starts from random weights (the projector of a new VLM)."""
    from vlm.modeling.vision_hub import weights_digest

    if hasattr(model, "projector"):
        count, digest = weights_digest(model.projector)
        log_line(f"[model] projector: new, random init ({model.config.projector.get('kind', 'default')}): "
                 f"{count} tensors, {digest}")


def check_init_from_type(path: Path, kind: str) -> None:
    """``model.init_from`` takes our own exports only; anything else is one line naming its type."""
    found = model_type_of(path, "model.init_from")
    want = OWN_TYPES[kind]
    if found == want:
        return
    if kind == "vlm" and found == "conceptmoe":
        hint = "a language model: start a VLM from it with model.llm"
    elif found in OWN_TYPES.values():
        hint = f"model.kind is {kind!r}"
    else:
        hint = "to start from a transformers model use model.llm (or python -m vlm.convert)"
    raise fail("model.init_from", f"{path} is a {found!r} checkpoint, not a {want!r} export ({hint})")


def log_init_from(model, path: Path, log_line) -> None:
    from vlm.modeling.vision_hub import weights_digest

    parts = [(name, getattr(model, name)) for name in ("vision", "projector", "language_model") if hasattr(model, name)]
    for name, module in parts or [("language model", model)]:
        count, digest = weights_digest(module)
        log_line(f"[model] {name.replace('_', ' ')} <- {path} (init_from): {count} tensors, {digest}")


# --- the model config and the model ----------------------------------------------------------
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
    from vlm.modeling.chat_template import ChatTokenizer

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
    from vlm.modeling.configuration_conceptmoe import ConceptMoEConfig
    from vlm.modeling.config_base import load_yaml
    from vlm.modeling.configuration_conceptmoe_vl import ConceptMoEVLMConfig

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
        from vlm.modeling.modeling_conceptmoe_vl import ConceptMoEVLMForConditionalGeneration

        return ConceptMoEVLMForConditionalGeneration
    from vlm.modeling.modeling_conceptmoe import ConceptMoEForCausalLM

    return ConceptMoEForCausalLM


def build_model(model_config, kind: str):
    return model_class(kind)(model_config)


def load_export(path: str, model_config, kind: str, log_line=print):
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
    log_init_from(model, Path(path), log_line)
    return model


def init_weights_from(model, path: str, kind: str, log_line=print) -> None:
    """Copy the weights of an HF export (``save_pretrained`` folder) into ``model`` (strict); one log
    line per part. A foreign checkpoint, a missing / unexpected key or a shape mismatch is one line."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"config error: model.init_from: folder not found: {path} (run the previous stage first?)")
    check_init_from_type(path, kind)
    if kind == "vlm":
        from vlm.modeling.modeling_conceptmoe_vl import ConceptMoEVLMForConditionalGeneration as cls
    else:
        from vlm.modeling.modeling_conceptmoe import ConceptMoEForCausalLM as cls
    source = cls.from_pretrained(path).state_dict()
    bad = shape_mismatches(source, model.state_dict())
    if bad:
        raise ConfigError(f"config error: model.init_from: {path} does not match the model (shapes {bad[:3]})")
    missing, unexpected = load_state_dict_checked(model, source)
    if missing or unexpected:
        raise ConfigError(f"config error: model.init_from: {path} does not match the model "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    log_init_from(model, path, log_line)


def text_config_of(model_config):
    return getattr(model_config, "text_config", model_config)


def build_processor(model, tokenizer):
    """``ConceptMoEVLMProcessor`` for a VLM (image settings from its vision tower); None otherwise."""
    if tokenizer is None or not hasattr(model, "vision"):
        return None
    from vlm.modeling.processing_conceptmoe_vl import ConceptMoEVLMProcessor

    return ConceptMoEVLMProcessor.for_model(tokenizer, model)


@dataclass
class ModelSetup:
    tokenizer: object
    model_config: object
    model: object


def _export_bases(path: Path, kind: str) -> tuple[dict, dict | None]:
    """(text fields, vision/projector sections) of our export at ``path``."""
    from vlm.modeling.configuration_conceptmoe_vl import ConceptMoEVLMConfig

    check_init_from_type(path, kind)
    config = (ConceptMoEVLMConfig if kind == "vlm" else ConceptMoEConfig).from_pretrained(str(path))
    if kind == "vlm":
        return field_values(config.text_config), {"vision": config.vision, "projector": config.projector}
    return field_values(config), None


def _prepared_tokenizer(path: str, log_line):
    """The tokenizer at ``path`` made ready for images, with one line naming the tokens it gained."""
    tokenizer, added, n_original = load_tokenizer_prepared(path)
    if added:
        log_line(f"[model] tokenizer {path}: added {', '.join(added)} (ids {len(tokenizer) - len(added)}.."
                 f"{len(tokenizer) - 1})")
    return tokenizer, added, n_original


def from_preset(cfg: TrainConfig, log_line=print) -> ModelSetup:
    """``model.preset``: random weights, or ``model.init_from`` an export of the same architecture."""
    m = cfg.model
    tokenizer = load_tokenizer(m.tokenizer)
    model_config = build_model_config(cfg, tokenizer)
    model = build_model(model_config, m.kind)
    if m.init_from:
        init_weights_from(model, m.init_from, m.kind, log_line)
    else:
        from vlm.modeling.vision_hub import weights_digest

        count, digest = weights_digest(getattr(model, "language_model", model))
        log_line(f"[model] language model: random init from the preset {m.preset} (no model.llm / init_from): "
                 f"{count} tensors, {digest}")
        log_new_parts(model, log_line)
    return ModelSetup(tokenizer, model_config, model)


def from_parts(cfg: TrainConfig, log_line=print) -> ModelSetup:
    """``model.llm`` (+ the preset's ``vision:`` / ``projector:``): the pretrained language model and its
    tokenizer, a new projector; ``model.init_from`` then overwrites every weight with an export's."""
    m = cfg.model
    llm = read_llm(m.llm)
    tokenizer, added, n_original = _prepared_tokenizer(m.tokenizer or m.llm, log_line)
    model_config = build_model_config(cfg, tokenizer, field_values(llm.config))
    model = build_model(model_config, m.kind)
    new_ids = tokenizer.convert_tokens_to_ids(added) if added else []
    load_llm_into(model, llm, new_ids, n_original, log_line)
    log_new_parts(model, log_line)
    if m.init_from:
        init_weights_from(model, m.init_from, m.kind, log_line)
    return ModelSetup(tokenizer, model_config, model)


def from_export(cfg: TrainConfig, log_line=print) -> ModelSetup:
    """``preset: null`` + ``model.init_from``: an export with its own architecture (+ model overrides)."""
    m = cfg.model
    text_base, vlm_base = _export_bases(Path(m.init_from), m.kind)
    tokenizer, _, _ = _prepared_tokenizer(m.tokenizer or m.init_from, log_line)
    model_config = build_model_config(cfg, tokenizer, text_base, vlm_base)
    return ModelSetup(tokenizer, model_config, load_export(m.init_from, model_config, m.kind, log_line))


def setup_model(cfg: TrainConfig, log_line=print) -> ModelSetup:
    """Tokenizer, model config and model with its starting weights, every part logged: pretrained
    parts if ``model.llm`` is set, else an export if ``model.preset`` is null, else the preset."""
    if cfg.model.llm:
        return from_parts(cfg, log_line)
    if cfg.model.preset is None:
        return from_export(cfg, log_line)
    return from_preset(cfg, log_line)
