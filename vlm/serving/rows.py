"""Slot surgery on a ``DecodeState``: rows join (``join_rows``) and leave (``keep_rows``) a running batch.

A request is prefilled alone on a batch-1 state of the engine's token capacity; joining concatenates
every tensor of the states along the batch, so the token caches turn ragged (each row writes at its own
``len_B``, attends its own ``valid_BC`` slots, RoPE at its own ``next_pos_B``). Concept caches of
different (grown) capacities are grown to the largest first. The host bounds (``size``) are set from
the host-known row lengths, never read from the device.
"""
from __future__ import annotations

import dataclasses

import torch

from vlm.modeling.attention import KVCache
from vlm.modeling.cache import select_rows
from vlm.modeling.generation import ConceptKVCache, DecodeState


def _cat_kv(caches: list[KVCache], size: int) -> KVCache:
    """One cache holding the rows of ``caches`` (ragged; ``size`` the host bound of the longest row)."""
    if isinstance(caches[0], ConceptKVCache):
        top = max(c.capacity for c in caches)
        for c in caches:
            c.grow(top)
    out = caches[0]
    for name, value in vars(caches[0]).items():
        if torch.is_tensor(value):
            setattr(out, name, torch.cat([getattr(c, name) for c in caches], 0))
    out.size, out.ragged, out.dense, out.static = int(size), True, False, False
    return out


def _cat_field(values: list):
    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        raise ValueError("join_rows: states started differently (a carry field set in some rows only)")
    return torch.cat(values, 0)


def join_rows(states: list[DecodeState], token_size: int) -> DecodeState:
    """The rows of ``states`` (eager, all prefilled at the same token capacity) as one state; the first
    state's objects are reused. ``token_size``: the longest row's token length (host-known)."""
    if len(states) == 1 and not states[0].token_caches[0].ragged:
        return states[0]
    caps = {s.token_caches[0].capacity for s in states}
    if len(caps) != 1:
        raise ValueError(f"join_rows: token capacities differ ({sorted(caps)})")
    if any(s.runner is not None for s in states):
        raise ValueError("join_rows: eager states only (a fixed-shape step holds its own buffers)")
    concept_size = max((c.size for s in states for c in s.concept_caches[:1]), default=0)
    out = states[0]
    out.token_caches = [_cat_kv([s.token_caches[i] for s in states], token_size)
                        for i in range(len(out.token_caches))]
    out.concept_caches = [_cat_kv([s.concept_caches[i] for s in states], concept_size)
                          for i in range(len(out.concept_caches))]
    skip = {"token_caches", "concept_caches"}
    for f in dataclasses.fields(DecodeState):
        if f.name not in skip:
            setattr(out, f.name, _cat_field([getattr(s, f.name) for s in states]))
    return out


def keep_rows(state: DecodeState, keep: list[int], token_size: int) -> DecodeState:
    """``state`` with only the rows ``keep`` (host indices), in place; ``token_size``: the longest kept
    row's token length (host-known), the token caches' new bound."""
    device = state.next_pos_B.device
    select_rows(state, torch.tensor(keep, dtype=torch.long, device=device))
    for cache in state.token_caches:
        cache.size = int(token_size)
    return state


def held_bytes(state: DecodeState | None) -> int:
    """Bytes of every cache tensor of ``state`` as allocated (host: from shapes, no device read)."""
    if state is None:
        return 0
    total = 0
    for cache in [*state.token_caches, *state.concept_caches]:
        for value in vars(cache).values():
            if torch.is_tensor(value):
                total += value.numel() * value.element_size()
    return total
