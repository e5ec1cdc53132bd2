"""Small OLMoE / Qwen3-MoE models built with transformers' own classes (random init, fixed seed), saved
as safetensors, and the same weights imported with the project's importer (``vlm.hf_import``) and
converted to a ConceptMoE (``vlm.convert``). Used by benchmarks/vs_transformers.py.

transformers runs its experts with ``experts_implementation="grouped_mm"`` (its ``_grouped_mm``
dispatcher: ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` where ``_can_use_grouped_mm``
allows, on CPU from torch 2.9) and ``attn_implementation="sdpa"``; both are checked after loading.
"""
from __future__ import annotations

from pathlib import Path

import torch

SHAPES = {  # the same shape for both families; vocabulary, hidden size, layers, experts, top-k, expert width
    "smoke": dict(vocab_size=2048, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  num_experts=4, num_experts_per_tok=2, intermediate_size=64),
    "cpu": dict(vocab_size=16384, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                num_experts=32, num_experts_per_tok=8, intermediate_size=256),
    "gpu": dict(vocab_size=32768, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                num_key_value_heads=4, num_experts=64, num_experts_per_tok=8, intermediate_size=512),
}
FAMILIES = ("olmoe", "qwen3_moe")


def hf_config(family: str, shape: dict, max_len: int):
    import transformers as T

    common = dict(shape, max_position_embeddings=max(max_len, 4096), rms_norm_eps=1e-5, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "olmoe":
        return T.OlmoeConfig(**common)
    if family == "qwen3_moe":
        inter = common.pop("intermediate_size")
        return T.Qwen3MoeConfig(**common, intermediate_size=inter, moe_intermediate_size=inter, norm_topk_prob=True,
                                head_dim=shape["hidden_size"] // shape["num_attention_heads"])
    raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")


def build_hf(family: str, shape: dict, folder: Path, max_len: int, seed: int = 0) -> Path:
    """A seeded random transformers model of ``family`` saved to ``folder`` (fp32 safetensors)."""
    import transformers as T

    cls = {"olmoe": T.OlmoeForCausalLM, "qwen3_moe": T.Qwen3MoeForCausalLM}[family]
    torch.manual_seed(seed)
    model = cls(hf_config(family, shape, max_len)).float()
    model.save_pretrained(folder)
    return folder


def load_hf(family: str, folder: Path, device, dtype):
    """The saved transformers model with grouped_mm experts and sdpa attention (checked)."""
    import transformers as T

    cls = {"olmoe": T.OlmoeForCausalLM, "qwen3_moe": T.Qwen3MoeForCausalLM}[family]
    model = cls.from_pretrained(folder, dtype=dtype, experts_implementation="grouped_mm",
                                attn_implementation="sdpa").to(device)
    impl = (model.config._experts_implementation, model.config._attn_implementation)
    if impl != ("grouped_mm", "sdpa"):
        raise RuntimeError(f"{family}: transformers chose experts/attention {impl}, not grouped_mm/sdpa")
    return model


def load_ours(folder: Path, converted: Path, ratio: float, device, dtype, seed: int = 0, concept: bool = True):
    """(plain import, ConceptMoE converted at ``ratio`` with strategy topk) of the saved checkpoint;
    ``concept=False``: (plain import, None), nothing converted."""
    from vlm.convert import convert
    from vlm.hf_import import import_hf

    plain = import_hf(folder).to(device=device, dtype=dtype)
    if not concept:
        return plain, None
    _, con, _ = convert(folder, converted, ratio, "topk", seed=seed)
    return plain, con.to(device=device, dtype=dtype).eval()


def kv_bytes_hf(cache) -> dict:
    """Allocated bytes of a transformers cache (keys + values of every layer; held = allocated for
    DynamicCache, the whole max_cache_len for StaticCache)."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if torch.is_tensor(t):
                total += t.nbytes
    return {"allocated_bytes": total}


def kv_bytes_ours(state) -> dict:
    """Allocated (k/v buffers) and held (valid entries) bytes of a DecodeState, token and concept layers."""
    tok, con = state.token_caches, list(state.concept_caches)
    out = {}
    for name, caches in (("token", tok), ("concept", con)):
        out[name] = {"allocated_bytes": sum(c.k.nbytes + c.v.nbytes for c in caches),
                     "held_bytes": sum(c.nbytes() for c in caches), "layers": len(caches)}
    out["allocated_bytes"] = out["token"]["allocated_bytes"] + out["concept"]["allocated_bytes"]
    out["held_bytes"] = out["token"]["held_bytes"] + out["concept"]["held_bytes"]
    return out
