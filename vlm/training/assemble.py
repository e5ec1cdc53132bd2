"""A model from pretrained parts. ``model.llm`` names the language model: a transformers checkpoint
(imported by ``vlm.hf_import``) or a ConceptMoE folder (e.g. ``python -m vlm.convert`` output). Its own
tokenizer is made ready for images (``data_pipelines.llm_tokenizer``); the vision tower is the one
``model.vision`` names (loaded by ``vision_encoders``); the projector is new. ``model.init_from`` with
``model.preset: null`` continues from an export (its own architecture). Each part logs one line.

New token rows (``<image>``, ``<im_start>``, ``<im_end>``, and a pad or role tokens where the LLM lacks
them) start as the mean of the LLM's own token rows, in the input embeddings and the LM head.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vlm.modeling.config_base import ConfigError, fail
from vlm.modeling.configuration_conceptmoe import FIELD_OWNER, ConceptMoEConfig
from vlm.modeling.safe_loading import load_state_dict_checked, read_json, require_safetensors

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


def load_llm_into(model, llm: LLMWeights, new_ids: list[int], n_original: int, say) -> None:
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
    say(f"[model] language model <- {llm.path} ({llm.what}): {count} tensors, {digest}{added}")


def log_new_parts(model, say) -> None:
    """One line for each part that starts from random weights (the projector of a new VLM)."""
    from vlm.modeling.vision_hub import weights_digest

    if hasattr(model, "projector"):
        count, digest = weights_digest(model.projector)
        say(f"[model] projector: new, random init ({model.config.projector.get('kind', 'default')}): "
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


def log_init_from(model, path: Path, say) -> None:
    from vlm.modeling.vision_hub import weights_digest

    parts = [(name, getattr(model, name)) for name in ("vision", "projector", "language_model") if hasattr(model, name)]
    for name, module in parts or [("language model", model)]:
        count, digest = weights_digest(module)
        say(f"[model] {name.replace('_', ' ')} <- {path} (init_from): {count} tensors, {digest}")
