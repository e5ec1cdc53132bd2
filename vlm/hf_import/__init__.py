"""Import a transformers checkpoint (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE)
into ``ConceptMoEForCausalLM``: the plain import (chunking off, vocabulary unchanged) whose logits
equal the transformers model's. ``configs.py`` maps the config (and refuses what it cannot carry
over), ``weights.py`` the tensors, ``check.py`` compares logits. Entry point: ``python -m vlm.convert``.
"""
from __future__ import annotations

import json
from pathlib import Path

from vlm.hf_import.configs import FAMILIES, imported_config
from vlm.hf_import.weights import map_weights, read_safetensors
from vlm.modeling.modeling_conceptmoe import ConceptMoEForCausalLM
from vlm.modeling.safe_loading import load_state_dict_checked, require_safetensors


def hf_family(src: Path) -> str | None:
    """The importable family of a checkpoint folder (its ``model_type``), or None."""
    try:
        kind = json.loads((Path(src) / "config.json").read_text()).get("model_type", "")
    except (OSError, ValueError):
        return None
    return kind if kind in FAMILIES else None


def load_hf_config(src: Path):
    """The transformers config (its own class fills the family defaults); no remote code."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(src), trust_remote_code=False)


def import_hf(src: Path) -> ConceptMoEForCausalLM:
    """The plain import of the transformers checkpoint folder ``src`` (in memory, eval mode)."""
    src = Path(src)
    require_safetensors(src)
    cfg = imported_config(load_hf_config(src))
    sd = map_weights(read_safetensors(src), cfg.tie_word_embeddings)
    dtype = sd["model.embed_tokens.weight"].dtype
    model = ConceptMoEForCausalLM(cfg).to(dtype)
    missing, unexpected = load_state_dict_checked(model, sd)
    if unexpected:
        raise ValueError(f"weights with no home in the imported model: {unexpected[:5]}")
    if missing:
        raise ValueError(f"the checkpoint lacks weights the imported model needs: {missing[:5]}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


__all__ = ["FAMILIES", "hf_family", "import_hf", "imported_config", "load_hf_config", "map_weights"]
