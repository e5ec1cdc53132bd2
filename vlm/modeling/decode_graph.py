"""The decode step at fixed shapes, eager or captured: ``decode="static"`` or ``decode="compiled"``.

``decode_step`` (generation.py, ``decode="eager"``) attends the slots [0, host bound + 1) of every KV
cache: a shape that changes with each token. ``StaticStep`` runs the same phases on caches in static
mode (``KVCache.static``: each row writes at its ``len_B``, a step attends every slot of the capacity
under the ``valid_BC`` mask, as transformers' ``StaticCache``) and keeps every tensor the step reads or
writes at one address for the life of the step, which the model keeps across ``generate`` calls
(``DecodeGraphs``, decode_pool.py: one step per batch size and capacity bucket): the state fields a
phase reassigns and the phases' results are copied into buffers. Each phase is then one graph of fixed
shapes that a CUDA graph replays:

- ``"static"``: the fixed-shape phases, eager (the reference of ``"compiled"``; any device);
- ``"compiled"``: each phase under ``torch.compile(fullgraph=True)``: on CUDA ``mode="reduce-overhead"``
  (inductor's kernels replayed as CUDA graphs, every buffer marked a static address), on the CPU
  inductor's default mode (there is no CUDA graph on the CPU);
- ``"cudagraph"`` (CUDA only): each eager phase captured as a ``torch.cuda.CUDAGraph``: seconds instead
  of inductor's minutes of compilation for a deep model, the eager kernels. A phase runs eagerly on a
  side stream the first time (the warm-up ``torch.cuda.graph`` wants, and that step's real work), is
  captured the second time and replayed (capture records without running) and every time after.

The plain MoE's step is one graph. The ConceptMoE's is three (token phase, concept phase, decoder
phase): the boundary read between the first two (the step's one host read) chooses whether the
concept graph runs. Why the whole capacity rather than length buckets: the token caches hold
``capacity_bucket(prompt + new tokens)`` slots (at least 64, rounded up to an eighth of its power of
two), so a step attends at most 1/8 more slots than the longest sequence needs, with one graph per
phase, nothing to recapture as the sequence grows and nothing to compile or capture for a later call
in the same bucket. A concept cache
that grows (``ConceptKVCache.reserve``, between steps) changes shape: the concept graph recompiles
(torch.compile's shape guards) and the new buffers are marked static again.
"""
from __future__ import annotations

import copy
import functools
import logging
import weakref

import torch

from .conceptmoe import ConceptMoEModel
from .decode_pool import CARRY, DecodeGraphs, capacity_bucket, detach, fill_slots, share
from .generation import (
    DecodeState,
    boundary_read,
    concept_phase,
    decode_step,
    decoder_phase,
    token_phase,
)

log = logging.getLogger(__name__)



def decode(model: ConceptMoEModel, state: DecodeState, input_ids_B1: torch.Tensor) -> torch.Tensor:
    """One decoding step in the state's mode (``state.decode``); the normed hidden state [B, 1, D]."""
    if state.decode == "eager":
        return decode_step(model, state, input_ids_B1)
    if state.runner is None:
        graphs = model.__dict__.get("_decode_graphs")
        if graphs is None:
            graphs = model._decode_graphs = DecodeGraphs()
        state.runner = graphs.step_for(model, state, StaticStep)
    return state.runner(input_ids_B1)


class StaticStep:
    """The fixed-shape decoding step of one key of ``DecodeGraphs`` (decode_pool.py; see the module
    docstring): a state of its own (``slot``: every buffer the graphs read or write, token caches of
    ``capacity`` slots) and ``io``, on which the graphs are compiled or captured once. A decoding state
    ``adopt``s it (copied in, then sharing the slot's buffers) at its first step; the state that held it
    before gets copies of its own. ``in_place``: ``state``'s own buffers are the slot (no copy; its owner
    keeps them where no other state adopts them: the serving engine's slot table, vlm/serving/slots.py)."""

    def __init__(self, model: ConceptMoEModel, state: DecodeState, capacity: int | None = None,
                 in_place: bool = False):
        cfg = model.cfg
        self.model = model
        self.compiled = state.decode == "compiled"
        self.cuda = state.next_pos_B.device.type == "cuda"
        if self.compiled and not self.cuda:
            log.info("decode='compiled' on %s: torch.compile with inductor's default mode (no CUDA graph there)",
                     state.next_pos_B.device.type)
        if in_place:
            slot = self.slot = state
            for cache in slot.token_caches + slot.concept_caches:
                cache.static = True
        else:
            capacity = capacity or capacity_bucket(state.token_caches[0].capacity)
            slot = self.slot = DecodeState([empty_cache(c, capacity) for c in state.token_caches],
                                           [empty_cache(c, c.capacity) for c in state.concept_caches])
            for name in CARRY:  # buffers of its own (the prefill's may be views of its inputs)
                t = getattr(state, name)
                setattr(slot, name, None if t is None else torch.empty_like(t, memory_format=torch.contiguous_format))
            slot.decode = state.decode
        B, D, dev = state.next_pos_B.shape[0], cfg.hidden_size, state.next_pos_B.device
        dtype = model.embed_tokens.weight.dtype
        head_dim = cfg.head_dim or D // cfg.num_attention_heads
        self.io = {"ids": torch.zeros(B, 1, dtype=torch.long, device=dev),
                   "x": torch.zeros(B, 1, D, dtype=dtype, device=dev),
                   "cos": torch.zeros(B, 1, head_dim, dtype=dtype, device=dev),
                   "sin": torch.zeros(B, 1, head_dim, dtype=dtype, device=dev),
                   "out": torch.zeros(B, 1, D, dtype=dtype, device=dev)}
        if cfg.chunking:
            self.io.update(b=torch.zeros(B, dtype=torch.bool, device=dev),
                           concept=torch.zeros(B, D, dtype=dtype, device=dev),
                           weight=torch.zeros(B, dtype=torch.float32, device=dev))
        self.owner = lambda: None  # the state holding the slot (a weak reference)
        self._captured: dict = {}  # "cudagraph": phase graph -> its CUDAGraph, or None once warmed up
        if in_place:
            state.runner, self.owner = self, weakref.ref(state)
        else:
            self.adopt(state)
        self._concept_k = slot.concept_caches[0].k if slot.concept_caches else None
        self._mark_static(all_of_it=True)

    def adopt(self, state: DecodeState) -> None:
        """``state`` (after its prefill, or detached) copied into the slot, then sharing its buffers; the
        slots past ``state``'s capacity invalid. A concept cache the prefill grew past the slot's
        capacity gets buffers of that size (the concept graph then recompiles / recaptures, as after
        a growth between steps)."""
        before = self.owner()
        if before is not None and before is not state and before.runner is self:
            detach(before)
        slot = self.slot
        for mine, theirs in zip(slot.token_caches + slot.concept_caches, state.token_caches + state.concept_caches):
            if mine is theirs:
                continue
            if theirs.capacity > mine.capacity:
                mine.k, mine.v = theirs.k.new_zeros(theirs.k.shape), theirs.v.new_zeros(theirs.v.shape)
                mine.valid_BC = theirs.valid_BC.new_zeros(theirs.valid_BC.shape)
            fill_slots(mine.k, theirs.k, 2)
            fill_slots(mine.v, theirs.v, 2)
            mine.valid_BC.zero_()
            fill_slots(mine.valid_BC, theirs.valid_BC, 1)
            mine.len_B.copy_(theirs.len_B)
            mine.size, mine.ragged, mine.dense, mine.static = theirs.size, theirs.ragged, theirs.dense, True
        for name in CARRY:
            buf, t = getattr(slot, name), getattr(state, name)
            if buf is not t:
                buf.copy_(t)
        share(state, slot)
        state.runner, self.owner = self, weakref.ref(state)

    @torch.no_grad()
    def __call__(self, input_ids_B1: torch.Tensor) -> torch.Tensor:
        state, io = self.slot, self.io
        tokens = state.token_caches
        if tokens[0].size >= tokens[0].capacity:
            raise ValueError(f"KV cache full (capacity {tokens[0].capacity})")
        for cache in state.concept_caches:  # growth between steps, never inside a graph
            cache.reserve()
        if state.concept_caches and state.concept_caches[0].k is not self._concept_k:  # grown: new buffers
            self._mark_static(grown=True)
            self._captured.pop(concept_graph, None)
            self._concept_k = state.concept_caches[0].k
        io["ids"].copy_(input_ids_B1)
        if not self.model.cfg.chunking:
            self._run(whole_graph)
        else:
            self._run(token_graph)
            commit, lens = boundary_read(io["b"], state.concept_caches)
            size = max(lens)
            if any(commit):
                self._run(concept_graph)
                size = max(n + c for n, c in zip(lens, commit))
            for cache in state.concept_caches:
                cache.size = size
            self._run(decoder_graph)
        for cache in tokens:
            cache.size += 1
        return io["out"].clone()

    def _run(self, graph) -> None:
        if self.slot.decode == "cudagraph":
            return self._replay(graph)
        if not self.compiled:
            return graph(self.model, self.slot, self.io)
        try:
            compiled_graph(graph, self.cuda, self.model.cfg.runtime.decode_compile_backend)(self.model, self.slot, self.io)
        except torch._dynamo.exc.FailOnRecompileLimitHit as e:  # (fullgraph: dynamo fails, never runs eager)
            raise RuntimeError(f"decode='compiled': torch.compile's recompile limit "
                               f"({torch._dynamo.config.recompile_limit}) reached for {graph.__name__} (one version "
                               "per batch size and capacity bucket kept): call model.release_decode_graphs() "
                               "and torch._dynamo.reset(), or raise torch._dynamo.config.recompile_limit") from e

    def _replay(self, graph) -> None:
        """"cudagraph": warm up (eager, side stream), then capture, then replay (module docstring)."""
        run = functools.partial(graph, self.model, self.slot, self.io)
        if graph not in self._captured:
            warm_up(run)
            self._captured[graph] = None
            return
        if self._captured[graph] is None:
            self._captured[graph] = capture(run)
        self._captured[graph].replay()

    def _mark_static(self, all_of_it: bool = False, grown: bool = False) -> None:
        """CUDA graphs (compiled on CUDA): every buffer the graphs read or write is a static address;
        after a concept cache grew, its new buffers too. Guarded (the default): the compiled code is
        this slot's, whose buffers never move, so a later call replays the same CUDA graphs."""
        if not (self.compiled and self.cuda):
            return
        state = self.slot
        caches = state.concept_caches if grown else state.token_caches + state.concept_caches
        tensors = [getattr(c, n) for c in caches for n in ("k", "v", "valid_BC", "len_B")]
        if all_of_it:
            tensors += [t for t in (getattr(state, n) for n in CARRY) if t is not None] + list(self.io.values())
        for t in tensors:
            torch._dynamo.mark_static_address(t)


def empty_cache(cache, capacity: int):
    """A cache object like ``cache`` (same class and host fields) on zero buffers of ``capacity`` slots."""
    out = copy.copy(cache)
    B, H, _, D = cache.k.shape
    out.k = cache.k.new_zeros(B, H, capacity, D)
    out.v = cache.v.new_zeros(B, H, capacity, D)
    out.valid_BC = cache.valid_BC.new_zeros(B, capacity)
    out.len_B = torch.zeros_like(cache.len_B)
    return out


def warm_up(run) -> None:
    """``run()`` eagerly on a side stream, as ``torch.cuda.graph`` wants before a capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)


def capture(run) -> torch.cuda.CUDAGraph:
    """``run()`` recorded (not run) as a CUDA graph; ``replay()`` runs it on the same buffers."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


_COMPILED: dict = {}


def compiled_graph(graph, cuda: bool, backend="inductor"):
    """``torch.compile`` of one phase graph with ``backend`` (the model's ``runtime.decode_compile_backend``;
    the unit tests: "eager", dynamo's trace without code generation), made once per process and backend
    (its compiled code is kept per function; guards on shapes and config choose between versions).
    fullgraph: a graph break is an error, never a silent split."""
    key = (graph, cuda, backend)
    if key not in _COMPILED:
        mode = ("reduce-overhead" if cuda else None) if backend == "inductor" else None
        _COMPILED[key] = torch.compile(graph, backend=backend, fullgraph=True, mode=mode)
    return _COMPILED[key]


# the graphs: each reads its inputs from ``io`` and the state, writes its results into ``io`` and the
# state fields it reassigns back into their buffers (fixed addresses; no tensor leaves a graph)
def whole_graph(model, state, io) -> None:
    """The plain MoE's step: embedding, all layers, final norm."""
    held = _held(state)
    x, cos_sin, _ = token_phase(model, state, io["ids"])
    _put(io["out"], decoder_phase(model, state, x, cos_sin))
    _keep(state, held)


def token_graph(model, state, io) -> None:
    held = _held(state)
    x, (cos, sin), (b_B, concept_BD, weight_B) = token_phase(model, state, io["ids"])
    for name, t in (("x", x), ("cos", cos), ("sin", sin), ("b", b_B), ("concept", concept_BD), ("weight", weight_B)):
        _put(io[name], t)
    _keep(state, held)


def concept_graph(model, state, io) -> None:
    held = _held(state)
    concept_phase(model, state, io["concept"], io["weight"], io["b"], None)
    _keep(state, held)


def decoder_graph(model, state, io) -> None:
    held = _held(state)
    _put(io["out"], decoder_phase(model, state, io["x"], (io["cos"], io["sin"])))
    _keep(state, held)


def _held(state) -> dict:
    return {name: getattr(state, name) for name in CARRY if getattr(state, name) is not None}


def _keep(state, held: dict) -> None:
    """Fields the phase reassigned: the new value copied into the old buffer, which stays the field."""
    for name, buf in held.items():
        t = getattr(state, name)
        if t is not buf:
            _put(buf, t)
            setattr(state, name, buf)


def _put(buf: torch.Tensor, t: torch.Tensor) -> None:
    if buf.shape != t.shape or buf.dtype != t.dtype:  # (checked when traced: shapes and dtypes are fixed)
        raise RuntimeError(f"decode graph: a {tuple(t.shape)} {t.dtype} result for a {tuple(buf.shape)} "
                           f"{buf.dtype} buffer")
    buf.copy_(t)
