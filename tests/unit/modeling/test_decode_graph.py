"""vlm/modeling/decode_graph.py: the fixed-shape decode step ("static") and its compiled form ("compiled")
give the eager step's greedy tokens, each phase is one graph, and recompiles stay bounded (issue 35, item 2).

"compiled" runs here with the ``aot_eager`` backend (dynamo's trace and aot's functionalized graphs,
no code generation: seconds) counted by ``CompileCounterWithBackend``; inductor's generated code
(minutes cold on 2 busy cores) is the integration-marked test at the end. Not run on a GPU here: on
CUDA "compiled" is ``mode="reduce-overhead"`` (CUDA graphs), which the CPU cannot exercise.
Routers: decisive (p exactly 0 or 1, conftest), so a last-bit difference between attending the
host bound and the whole capacity cannot flip a boundary.
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from vlm.modeling import decode_graph, generation
from vlm.modeling.cache import ConceptCache
from vlm.modeling.hf_features import generation_cache_key, returned_cache

from _device import cuda_only, dev, require_test_device  # noqa: F401
from _cuda_on_cpu import FakeGraph
from conftest import build_model, decisive, left_padded, randomise_joint

pytestmark = pytest.mark.device

PRESETS = ["tiny", "tiny_concept"]
BACKEND = "eager"  # dynamo's trace run as is (aot_eager: +functionalization, 2x slower)
GRAPHS = {"tiny": 1, "tiny_concept": 3}  # the plain MoE's whole step; token, concept, decoder phases


def _model(preset: str, backend=None, **overrides):
    """``backend``: the model's ``runtime.decode_compile_backend`` (the ``counter`` fixture's)."""
    model = build_model(preset, **overrides)
    if backend is not None:
        model.config.runtime.decode_compile_backend = backend
    if model.config.chunking:
        decisive(randomise_joint(model), 3)
    return dev(model)


@pytest.fixture
def counter(monkeypatch):
    """"compiled" on dynamo's eager backend, counted (a model's ``runtime.decode_compile_backend``: ``_model(preset,
    counter)``); fresh compiled code for the test."""
    torch._dynamo.reset()
    count = CompileCounterWithBackend(BACKEND)
    monkeypatch.setattr(decode_graph, "_COMPILED", {})
    yield count
    torch._dynamo.reset()


def _loop(model, decode: str, ids, am, steps: int, capacity: int | None = None):
    """prefill + ``steps`` greedy ``step``s; (tokens [B, steps + 1], logits [B, steps + 1, V])."""
    B, T = ids.shape
    with torch.no_grad():
        state = model.start_decoding(B, capacity or T + steps + 1, decode=decode)
        logits = [model.prefill(state, ids, attention_mask=am)]
        for _ in range(steps):
            logits.append(model.step(state, logits[-1].argmax(-1)))
    logits = torch.stack(logits, 1)
    return logits.argmax(-1), logits


@pytest.mark.parametrize("preset", PRESETS)
def test_static_and_compiled_steps_equal_eager(preset, counter):
    """The low-level loop (``start_decoding(decode=...)``, ``prefill``, ``step``), batch 3 with a
    left-padded row, 24 tokens: the same greedy tokens in the three modes, logits to float rounding;
    "compiled" compiles each graph once over all the tokens and a second state of the same shapes."""
    model = _model(preset, counter)
    ids, am = dev(*left_padded(B=3, T=12, pad=4))
    want, want_logits = _loop(model, "eager", ids, am, 24)
    for decode in ("static", "compiled"):
        got, logits = _loop(model, decode, ids, am, 24)
        assert torch.equal(got, want), decode
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
    assert counter.frame_count == GRAPHS[preset]
    assert torch.equal(_loop(model, "compiled", ids, am, 24)[0], want)
    assert counter.frame_count == GRAPHS[preset]  # (another state: no recompile)


@pytest.mark.parametrize("beams", [1, 3], ids=["greedy", "beams"])
@pytest.mark.parametrize("preset", PRESETS)
def test_generate_static_and_compiled_equal_eager(preset, beams, counter):
    """Through transformers' GenerationMixin (``generate(decode=...)``, beam search reordering the
    buffers in place): the same sequences as the eager step; each graph compiled once."""
    model = _model(preset, counter)
    ids, am = dev(*left_padded(B=2, T=12, pad=4))
    kw = {"attention_mask": am, "do_sample": False, "num_beams": beams, "max_new_tokens": 12}
    want = model.generate(ids, **kw)
    for decode in ("static", "compiled"):
        assert torch.equal(model.generate(ids, decode=decode, **kw), want), decode
    assert counter.frame_count == GRAPHS[preset]


def test_given_cache_decodes_in_its_mode(counter):
    """A ``ConceptCache(decode="compiled")`` passed to generate decodes compiled; continued from the
    returned cache (more token slots: the fixed-shape step is rebuilt on them) the tokens still
    equal the eager path's."""
    model = _model("tiny", counter)  # (one graph: the cache's handling is the same for both stacks)
    ids, am = dev(*left_padded(B=2, T=12, pad=4))
    kw = {"attention_mask": am, "do_sample": False, "max_new_tokens": 6, "return_dict_in_generate": True}
    want = model.generate(ids, **{generation_cache_key(): ConceptCache(ids.shape[1] + 7)}, **kw)
    got = model.generate(ids, **{generation_cache_key(): ConceptCache(ids.shape[1] + 7, decode="compiled")}, **kw)
    assert torch.equal(got.sequences, want.sequences) and counter.frame_count == 1
    am2 = torch.cat([am, am.new_ones(2, 6)], 1)
    more = dict(kw, attention_mask=am2)
    want2 = model.generate(want.sequences, **{generation_cache_key(): returned_cache(want)}, **more)
    got2 = model.generate(got.sequences, **{generation_cache_key(): returned_cache(got)}, **more)
    assert torch.equal(got2.sequences, want2.sequences)


def test_concept_cache_growth_recompiles_the_concept_graph_only(counter, monkeypatch):
    """Concept caches planned for R = 16 with 2 slots of headroom while the router compresses ~3x: they
    grow between decoding steps; the tokens equal the eager path's, the token and decoder graphs
    compile once and the concept graph once more per shape change at most (after the first,
    torch.compile's automatic dynamic shapes take the capacity as a symbol)."""
    model = _model("tiny_concept", counter, concept_merge="sum", target_ratio=16.0, **{"runtime.concept_headroom": 2})
    ids, am = dev(*left_padded(B=2, T=20, pad=3))
    want, _ = _loop(model, "eager", ids, am, 30)
    with torch.no_grad():
        state = model.start_decoding(2, 20 + 31, decode="compiled")
        tok = model.prefill(state, ids, attention_mask=am).argmax(-1)
        planned, got = state.concept_caches[0].capacity, [tok]
        for _ in range(30):
            got.append(model.step(state, got[-1]).argmax(-1))
    grown = state.concept_caches[0].capacity
    assert grown > planned, (planned, grown)
    assert torch.equal(torch.stack(got, 1), want)
    assert 3 <= counter.frame_count <= 4


@pytest.mark.parametrize("preset", PRESETS)
def test_each_phase_graph_has_no_graph_break(preset):
    """``torch._dynamo.explain`` of each graph ``StaticStep`` runs: one graph, no break (fullgraph
    compiles would fail on a break too; this names it)."""
    model = _model(preset).model
    ids, am = dev(*left_padded(B=2, T=12, pad=4))
    with torch.no_grad():
        state = generation.DecodeState.allocate(model, 2, 24, ids.device, torch.float32, decode="static")
        model(input_ids=ids, attention_mask=am, state=state)
        runner = decode_graph.StaticStep(model, state)
        runner.io["ids"].copy_(ids[:, -1:])
        graphs = [decode_graph.whole_graph] if not model.cfg.chunking else \
            [decode_graph.token_graph, decode_graph.concept_graph, decode_graph.decoder_graph]
        for graph in graphs:
            torch._dynamo.reset()
            ex = torch._dynamo.explain(graph)(model, state, runner.io)
            assert (ex.graph_count, ex.graph_break_count) == (1, 0), \
                (graph.__name__, [str(r.reason)[:200] for r in ex.break_reasons])
    torch._dynamo.reset()


def test_decode_mode_is_checked():
    """An unknown mode, and "compiled" without a cache (use_cache=False) or against a given cache's
    mode: one line each, nothing falls back."""
    model = _model("tiny")
    ids = dev(torch.tensor([[5, 6, 7]]))
    with pytest.raises(ValueError, match="decode='graph' is not a decoding mode"):
        model.start_decoding(1, 8, decode="graph")
    with pytest.raises(ValueError, match="decode='graph' is not a decoding mode"):
        model.generate(ids, max_new_tokens=2, decode="graph")
    with pytest.raises(ValueError, match="needs the cache"):
        model.generate(ids, max_new_tokens=2, decode="compiled", use_cache=False)
    with pytest.raises(ValueError, match="the given cache decodes 'eager'"):
        model.generate(ids, max_new_tokens=2, decode="compiled", **{generation_cache_key(): ConceptCache(8)})
    if ids.device.type != "cuda":
        with pytest.raises(ValueError, match="decode='cudagraph' captures CUDA graphs: the model is on cpu"):
            model.generate(ids, max_new_tokens=2, decode="cudagraph")


@pytest.mark.parametrize("merge", ["last", "sum"])
def test_cudagraph_sequence_on_the_cpu(merge, monkeypatch):
    """The "cudagraph" mode's warm-up / capture / replay sequence with ``FakeGraph`` in place of CUDA:
    greedy and beam search give the eager path's tokens while concept caches grow (planned for
    R = 16 with 2 slots of headroom): each graph is captured once, the concept graph again after a
    growth (at most once per growth), and no captured buffer ever moves (beam reordering copies into them)."""
    monkeypatch.setattr(decode_graph, "warm_up", lambda run: run())
    monkeypatch.setattr(decode_graph, "capture", FakeGraph)
    monkeypatch.setattr(generation, "check_decode", lambda decode, device=None, dtype=None: decode)  # (CUDA only otherwise)
    monkeypatch.setattr(FakeGraph, "captures", 0)
    growths, reserve = [], generation.ConceptKVCache.reserve

    def counted(cache):
        before = cache.capacity
        reserve(cache)
        growths.append(cache.capacity > before)
    monkeypatch.setattr(generation.ConceptKVCache, "reserve", counted)
    model = _model("tiny_concept", concept_merge=merge, target_ratio=16.0, **{"runtime.concept_headroom": 2})
    ids, am = dev(*left_padded(B=2, T=20, pad=3))
    for beams in (1, 2):
        kw = {"attention_mask": am, "do_sample": False, "num_beams": beams, "max_new_tokens": 24}
        cache = ConceptCache(20 + 25, decode="cudagraph")
        got = model.generate(ids, **{generation_cache_key(): cache}, **kw)
        assert torch.equal(got, model.generate(ids, **kw)), beams
        grown = cache.state.concept_caches[0].capacity > -(-45 // 16) + 2
        assert grown and len(cache.state.runner._captured) == 3
    grown = sum(growths) // len(model.model.schedule)  # (every concept cache grows at the same step)
    assert grown and 6 < FakeGraph.captures <= 6 + grown, (FakeGraph.captures, grown)


@cuda_only  # not yet run on a GPU
@pytest.mark.parametrize("preset", PRESETS)
def test_cudagraph_replays_the_static_step(preset):
    """``decode="cudagraph"`` (bf16: the grouped GEMM serves it without a host read): the captured
    phases replay the eager fixed-shape step exactly (the same kernels), over enough tokens that every
    graph is warmed up, captured and replayed; beam search reorders the captured buffers in place."""
    model = _model(preset).to(torch.bfloat16)
    ids, am = dev(*left_padded(B=2, T=12, pad=4))
    for beams in (1, 2):
        kw = {"attention_mask": am, "do_sample": False, "num_beams": beams, "max_new_tokens": 16}
        want = model.generate(ids, decode="static", **kw)
        assert torch.equal(model.generate(ids, decode="cudagraph", **kw), want), beams


@pytest.mark.integration  # in-process, but inductor generates and compiles C++ for each graph: 1-3 min cold
def test_compiled_with_inductor_equals_eager(monkeypatch):
    """The default backend (inductor, CPU: its default mode, no CUDA graph): ``generate(decode="compiled")``
    of the ConceptMoE (its three graphs hold every op of the plain MoE's one) gives the eager path's
    greedy sequences."""
    monkeypatch.setattr(decode_graph, "_COMPILED", {})
    torch._dynamo.reset()
    model = _model("tiny_concept")
    ids, am = dev(*left_padded(B=2, T=12, pad=4))
    kw = {"attention_mask": am, "do_sample": False, "max_new_tokens": 12}
    assert torch.equal(model.generate(ids, decode="compiled", **kw), model.generate(ids, **kw))
    torch._dynamo.reset()
