"""Exports written before the fused expert weight hold each MoE layer's gate and up stacks apart
(``ffn.w_gate`` / ``ffn.w_up`` [E, D, I]); the model holds them as one ``ffn.w_gate_up`` [E, D, 2I].
``load_state_dict`` fuses them itself (``MoEFeedForward`` calls ``fuse_legacy_gate_up``); transformers'
``from_pretrained`` sets parameters by name, so after it ``fuse_after_from_pretrained`` copies the two
halves from the checkpoint's safetensors into every ``w_gate_up`` that was reported missing, and says
so in one line."""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)
HALVES = ("w_gate", "w_up")


def fuse_legacy_gate_up(state_dict: dict, prefix: str) -> None:
    """In place: ``{prefix}w_gate`` and ``{prefix}w_up`` [E, D, I] -> ``{prefix}w_gate_up`` [E, D, 2I].
    One half without the other is left alone, so the load reports it as unexpected."""
    gate, up = (prefix + h for h in HALVES)
    if gate in state_dict and up in state_dict and prefix + "w_gate_up" not in state_dict:
        state_dict[prefix + "w_gate_up"] = torch.cat([state_dict.pop(gate), state_dict.pop(up)], -1)


def _checkpoint_files(path, subfolder: str = "", **hub_kwargs) -> list[str]:
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, cached_file

    from .safe_loading import read_json

    kw = dict(subfolder=subfolder, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
    index = cached_file(path, SAFE_WEIGHTS_INDEX_NAME, **kw)
    if index:
        names = sorted(set(read_json(index)["weight_map"].values()))
        return [cached_file(path, n, **kw) for n in names]
    single = cached_file(path, SAFE_WEIGHTS_NAME, **kw)
    return [single] if single else []


def _match(stem: str, stems: set[str]) -> str | None:
    """The checkpoint stem for a model stem (base-model prefixes may differ: ``model.`` added or dropped)."""
    for s in stems:
        if s == stem or s.endswith("." + stem) or stem.endswith("." + s):
            return s
    return None


def fuse_after_from_pretrained(model, path, info: dict, subfolder: str = "", **hub_kwargs) -> int:
    """Fill every missing ``*.w_gate_up`` from the checkpoint's ``*.w_gate`` / ``*.w_up`` (updates
    ``info``'s missing / unexpected keys); returns how many stacks. Nothing to do: 0, no file read."""
    missing = [k for k in info["missing_keys"] if k.endswith(".w_gate_up")]
    unexpected = set(info["unexpected_keys"])
    stems = {k[:-len("w_gate")] for k in unexpected if k.endswith(".w_gate") and k[:-len("w_gate")] + "w_up" in unexpected}
    if not missing or not stems:
        return 0
    from safetensors import safe_open

    stem_of = {key: stem for key in missing if (stem := _match(key[:-len("w_gate_up")], stems)) is not None}
    wanted = {stem + h for stem in stem_of.values() for h in HALVES}
    tensors = {}
    for f in _checkpoint_files(path, subfolder, **hub_kwargs):
        with safe_open(f, "pt") as st:
            tensors.update({k: st.get_tensor(k) for k in wanted.intersection(st.keys())})
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, stem in stem_of.items():
            params[key].copy_(torch.cat([tensors[stem + h] for h in HALVES], -1))
    unexpected -= wanted
    info["missing_keys"] = type(info["missing_keys"])(k for k in info["missing_keys"] if k not in stem_of)
    info["unexpected_keys"] = type(info["unexpected_keys"])(k for k in info["unexpected_keys"] if k in unexpected)
    if stem_of:
        logger.warning("%s: %d expert stacks stored as w_gate / w_up (the layout before the fused w_gate_up) were "
                       "loaded fused; any 'newly initialized w_gate_up' report above is superseded", path, len(stem_of))
    return len(stem_of)
