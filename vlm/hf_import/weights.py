"""Transformers safetensors weights -> our parameter names and layouts.

Renames: ``input_layernorm`` -> ``input_norm``, ``post_attention_layernorm`` -> ``post_attn_norm``,
``self_attn`` -> ``attn``, dense ``mlp.*_proj`` -> ``ffn.*_proj``, router ``mlp.gate`` /
``block_sparse_moe.gate`` -> ``ffn.router``, ``shared_expert`` -> ``ffn.shared``,
``shared_expert_gate`` -> ``ffn.shared_gate``. Routed experts are stacked into ``w_gate_up``
``[E, D, 2I]`` (gate columns, then up) and ``w_down`` ``[E, I, D]`` (our layout is the transpose of
``nn.Linear``'s), from the
per-expert layout (``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, Mixtral's ``w1`` / ``w3`` /
``w2``) or the fused one (``experts.gate_up_proj`` ``[E, 2I, D]``, ``experts.down_proj`` ``[E, D, I]``).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_NAMES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_PLAIN = (("input_layernorm.", "input_norm."), ("post_attention_layernorm.", "post_attn_norm."),
          ("self_attn.", "attn."))


def read_safetensors(src: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors checkpoint folder."""
    from safetensors.torch import load_file

    index = src / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{src}: no *.safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(str(src / name)))
    return out


def _layer_key(rest: str, experts: dict, li: int) -> str | None:
    """Our name for one layer-local HF key; expert tensors are collected into ``experts`` (None)."""
    m = _EXPERT.match(rest)
    if m:
        experts.setdefault(li, {}).setdefault(_EXPERT_NAMES.get(m.group(2), m.group(2)), {})[int(m.group(1))] = rest
        return None
    for fused in ("gate_up_proj", "down_proj"):
        for pre in ("mlp.experts.", "block_sparse_moe.experts."):
            if rest in (pre + fused, pre + fused + ".weight"):
                experts.setdefault(li, {})["fused_" + fused] = rest
                return None
    for old, new in _PLAIN:
        if rest.startswith(old):
            return new + rest[len(old):]
    for pre in ("mlp.", "block_sparse_moe."):
        if rest.startswith(pre):
            tail = rest[len(pre):]
            if tail == "gate.weight":
                return "ffn.router.weight"
            if tail.startswith("shared_expert_gate."):
                return "ffn.shared_gate." + tail[len("shared_expert_gate."):]
            if tail.startswith("shared_expert."):
                return "ffn.shared." + tail[len("shared_expert."):]
            return "ffn." + tail
    raise ValueError(f"{rest}: a weight with no home in the imported model")


def _stack_experts(li: int, parts: dict, hf: dict) -> dict[str, torch.Tensor]:
    pre = f"model.layers.{li}.ffn."
    if "fused_gate_up_proj" in parts:  # [E, 2I, D] and [E, D, I]
        gate_up = hf[f"model.layers.{li}." + parts["fused_gate_up_proj"]]
        down = hf[f"model.layers.{li}." + parts["fused_down_proj"]]
        # [gate; up] rows -> [gate | up] columns: our w_gate_up [E, D, 2I] is its transpose
        return {pre + "w_gate_up": gate_up.transpose(1, 2).contiguous(), pre + "w_down": down.transpose(1, 2)}
    stacked = {}
    for name in ("gate", "up", "down"):
        per = parts.get(name, {})
        if sorted(per) != list(range(len(per))) or not per:
            raise ValueError(f"model.layers.{li}: expert {name} weights are incomplete ({sorted(per)})")
        stacked[name] = torch.stack([hf[f"model.layers.{li}." + per[e]].t() for e in range(len(per))])
    return {pre + "w_gate_up": torch.cat([stacked["gate"], stacked["up"]], -1), pre + "w_down": stacked["down"]}


def map_weights(hf: dict[str, torch.Tensor], tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
    """Our state dict (names and layouts) from a transformers causal-LM state dict."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[int, dict] = {}
    for key, t in hf.items():
        m = _LAYER.match(key)
        if m:
            ours = _layer_key(m.group(2), experts, int(m.group(1)))
            if ours is not None:
                out[f"model.layers.{m.group(1)}.{ours}"] = t
        elif key in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            out[key] = t
        elif key.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from rope_theta
        else:
            raise ValueError(f"{key}: a weight with no home in the imported model")
    for li, parts in experts.items():
        out.update(_stack_experts(li, parts, hf))
    if tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return {k: v.contiguous() for k, v in out.items()}
