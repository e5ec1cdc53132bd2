"""``DecodeGraphs``: the fixed-shape decoding steps of a model, kept across ``generate`` calls.

One ``StaticStep`` (decode_graph.py: persistent buffers, compiled code or captured CUDA graphs) per key
(decode mode, batch size, token capacity bucket, device, dtype, which carry fields exist), owned by the model
(``ConceptMoEModel.decode_graphs``) rather than by a call's state, as vLLM captures once per batch
bucket and transformers reuses its StaticCache. A new state adopts the step of its key at its first
decoding step: its tensors are copied into the step's buffers, which it then shares; a later call of
another prompt length or ``max_new_tokens`` in the same bucket replays without compiling or capturing.
Freed by ``release`` (``model.release_decode_graphs()``, and any move or dtype change of the model).
"""
from __future__ import annotations

import copy
import dataclasses

import torch

from .chunking import ChunkCarry

CARRY = ("next_pos_B",) + tuple(f.name for f in dataclasses.fields(ChunkCarry))  # state fields a phase reassigns
CAPACITY_MIN = 64  # the smallest capacity bucket (token slots)
BUCKETS_PER_OCTAVE = 8  # buckets between two powers of two: at most 1/8 more slots attended than needed


def capacity_bucket(capacity: int) -> int:
    """Token slots allocated for ``capacity``: at least ``CAPACITY_MIN``, rounded up to a multiple of
    1 / ``BUCKETS_PER_OCTAVE`` of the power of two below it (e.g. 25 -> 64, 100 -> 104, 8242 -> 9216), so
    prompts and ``max_new_tokens`` that differ a little share one step while a step attends at most
    1 / 8 more slots than the longest sequence needs."""
    n = max(int(capacity), CAPACITY_MIN)
    grain = max(1, (1 << (n.bit_length() - 1)) // BUCKETS_PER_OCTAVE)
    return -(-n // grain) * grain


class DecodeGraphs:
    """The model's fixed-shape decoding steps by key (module docstring). Not copied with the model
    (``copy.deepcopy``, pickling): a copy starts empty."""

    def __init__(self):
        self.steps: dict = {}

    def step_for(self, model, state, make_step):
        """The step of ``state``'s key, built on first use by ``make_step(model, state, capacity=)``
        (decode_graph.StaticStep), else with ``state`` adopted (``StaticStep.adopt``)."""
        tokens = state.token_caches[0]
        key = (state.decode, tokens.k.shape[0], capacity_bucket(tokens.capacity), tokens.k.device, tokens.k.dtype,
               tuple(name for name in CARRY if getattr(state, name) is not None))
        step = self.steps.get(key)
        if step is None:
            step = self.steps[key] = make_step(model, state, capacity=key[2])
        else:
            step.adopt(state)
        return step

    def release(self) -> None:
        """Drops every step; a state decoding on one keeps its buffers as its own (its next step adopts anew)."""
        for step in self.steps.values():
            owner = step.owner()
            if owner is not None and owner.runner is step:
                owner.runner = None
        self.steps.clear()

    def __deepcopy__(self, memo):
        return DecodeGraphs()

    def __getstate__(self):
        return {"steps": {}}


def share(state, slot) -> None:
    """``state`` made to hold ``slot``'s cache objects and carry buffers (the same objects)."""
    state.token_caches = list(slot.token_caches)
    state.concept_caches = list(slot.concept_caches)
    for name in CARRY:
        setattr(state, name, getattr(slot, name))


def detach(state) -> None:
    """``state`` given copies of everything it shares with its step's buffers, and no step: another
    state may take the buffers now, or this one replaces its tensors (batch rows, more slots)."""
    state.token_caches = [map_tensors(c, torch.Tensor.clone) for c in state.token_caches]
    state.concept_caches = [map_tensors(c, torch.Tensor.clone) for c in state.concept_caches]
    for name in CARRY:
        t = getattr(state, name)
        if t is not None:
            setattr(state, name, t.clone())
    state.runner = None


def map_tensors(cache, fn):
    """A cache object like ``cache`` (same class and host fields) with ``fn(t)`` for each of its tensors."""
    out = copy.copy(cache)
    for name, t in vars(cache).items():
        if torch.is_tensor(t):
            setattr(out, name, fn(t))
    return out


def fill_slots(buf: torch.Tensor, t: torch.Tensor, dim: int) -> None:
    """``t`` copied into the first slots of ``buf`` along ``dim`` (the capacity); the rest left as is
    (the caller invalidates them)."""
    buf.narrow(dim, 0, t.shape[dim]).copy_(t)
