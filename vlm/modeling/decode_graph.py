"""The decode step at fixed shapes, eager or captured: ``decode="static"`` or ``decode="compiled"``.

``decode_step`` (generation.py, ``decode="eager"``) attends the slots [0, host bound + 1) of every KV
cache: a shape that changes with each token. ``StaticStep`` runs the same phases on caches in static
mode (``KVCache.static``: each row writes at its ``len_B``, a step attends every slot of the capacity
under the ``valid_BC`` mask, as transformers' ``StaticCache``) and keeps every tensor the step reads or
writes at one address for the life of the state: the state fields a phase reassigns and the phases'
results are copied into buffers. Each phase is then one graph of fixed shapes that a CUDA graph replays:

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
concept graph runs. Why the whole capacity rather than length buckets: ``generate`` sizes the token
caches to prompt + new tokens, so a step attends at most ``max_new_tokens`` slots more than the
eager one, with one graph per phase and nothing to recapture as the sequence grows. A concept cache
that grows (``ConceptKVCache.reserve``, between steps) changes shape: the concept graph recompiles
(torch.compile's shape guards) and the new buffers are marked static again.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from .chunking import ChunkCarry
from .conceptmoe import ConceptMoEModel
from .generation import (
    DecodeState,
    boundary_read,
    concept_phase,
    decode_step,
    decoder_phase,
    token_phase,
)

log = logging.getLogger(__name__)

CARRY = ("next_pos_B",) + tuple(f.name for f in dataclasses.fields(ChunkCarry))  # state fields a phase reassigns


def decode(model: ConceptMoEModel, state: DecodeState, input_ids_B1: torch.Tensor) -> torch.Tensor:
    """One decoding step in the state's mode (``state.decode``); the normed hidden state [B, 1, D]."""
    if state.decode == "eager":
        return decode_step(model, state, input_ids_B1)
    if state.runner is None:
        state.runner = StaticStep(model, state)
    return state.runner(input_ids_B1)


class StaticStep:
    """The fixed-shape decoding step of one ``DecodeState`` after its prefill (see the module
    docstring). Built at the first decoding step; dropped (``state.runner = None``) by whatever
    replaces the state's tensors (a batch of another size, more token slots), rebuilt at the next."""

    def __init__(self, model: ConceptMoEModel, state: DecodeState):
        cfg = model.cfg
        self.model, self.state = model, state
        self.compiled = state.decode == "compiled"
        self.cuda = state.next_pos_B.device.type == "cuda"
        if self.compiled and not self.cuda:
            log.info("decode='compiled' on %s: torch.compile with inductor's default mode (no CUDA graph there)",
                     state.next_pos_B.device.type)
        for name in CARRY:  # buffers of its own (the prefill's may be views of its inputs)
            t = getattr(state, name)
            if t is not None:
                setattr(state, name, t.clone(memory_format=torch.contiguous_format))
        for cache in state.token_caches + state.concept_caches:
            cache.static = True
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
        self._concept_k = state.concept_caches[0].k if state.concept_caches else None
        self._captured: dict = {}  # "cudagraph": phase graph -> its CUDAGraph, or None once warmed up
        self._mark_static(all_of_it=True)

    @torch.no_grad()
    def __call__(self, input_ids_B1: torch.Tensor) -> torch.Tensor:
        state, io = self.state, self.io
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
        if self.state.decode == "cudagraph":
            return self._replay(graph)
        backend = self.model.cfg.runtime.decode_compile_backend
        (compiled_graph(graph, self.cuda, backend) if self.compiled else graph)(self.model, self.state, self.io)

    def _replay(self, graph) -> None:
        """"cudagraph": warm up (eager, side stream), then capture, then replay (module docstring)."""
        run = functools.partial(graph, self.model, self.state, self.io)
        if graph not in self._captured:
            warm_up(run)
            self._captured[graph] = None
            return
        if self._captured[graph] is None:
            self._captured[graph] = capture(run)
        self._captured[graph].replay()

    def _mark_static(self, all_of_it: bool = False, grown: bool = False) -> None:
        """CUDA graphs (compiled on CUDA): every buffer the graphs read or write is a static address;
        after a concept cache grew, its new buffers too. Unguarded: another state's buffers of the
        same shapes re-record the CUDA graphs instead of recompiling."""
        if not (self.compiled and self.cuda):
            return
        state = self.state
        caches = state.concept_caches if grown else state.token_caches + state.concept_caches
        tensors = [getattr(c, n) for c in caches for n in ("k", "v", "valid_BC", "len_B")]
        if all_of_it:
            tensors += [t for t in (getattr(state, n) for n in CARRY) if t is not None] + list(self.io.values())
        for t in tensors:
            torch._dynamo.mark_static_address(t, guard=False)


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
