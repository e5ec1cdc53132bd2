"""vlm/modeling/decode_pool.py: the fixed-shape decoding steps outlive a ``generate`` call (issue 39, item 5).

A second call of another prompt length and ``max_new_tokens`` in the same capacity bucket compiles
nothing ("compiled", counted on dynamo's eager backend) and captures nothing ("cudagraph" on the CPU
with tests/_cuda_on_cpu.py's ``FakeGraph``, which fails when a captured buffer moves); a state still
held (a returned cache) keeps its tensors when another call takes the step; a move or dtype change
and ``release_decode_graphs`` free the steps; CUDA graphs on CUDA refuse fp32 in one line; and what
docs/performance.md says about identical tokens (fp32) and near-ties (bf16).
"""
from __future__ import annotations

import pytest
import torch

from vlm.modeling import decode_graph, generation, modeling_conceptmoe
from vlm.modeling.decode_pool import capacity_bucket
from vlm.modeling.hf_features import generation_cache_key, returned_cache

from _device import dev, require_test_device  # noqa: F401
from conftest import build_model, left_padded
from _cuda_on_cpu import FakeGraph
from test_decode_graph import GRAPHS, _model, counter  # noqa: F401 (counter: a fixture)

PRESETS = ["tiny", "tiny_concept"]


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    """"cudagraph" on the CPU: ``FakeGraph`` captures (counted), warm-up runs the step."""
    monkeypatch.setattr(decode_graph, "warm_up", lambda run: run())
    monkeypatch.setattr(decode_graph, "capture", FakeGraph)
    for module in (generation, modeling_conceptmoe):  # (CUDA only otherwise)
        monkeypatch.setattr(module, "check_decode", lambda decode, device=None, dtype=None: decode)
    monkeypatch.setattr(FakeGraph, "captures", 0)
    return FakeGraph


def _calls():
    """Two generations in one bucket: prompts of 12 and 9 columns, 12 and 20 new tokens."""
    a, am_a = dev(*left_padded(B=2, T=12, pad=4))
    b, am_b = dev(*left_padded(B=2, T=9, pad=2, seed=2))
    assert capacity_bucket(12 + 12 + 1) == capacity_bucket(9 + 20 + 1)
    return [(a, {"attention_mask": am_a, "max_new_tokens": 12, "do_sample": False}),
            (b, {"attention_mask": am_b, "max_new_tokens": 20, "do_sample": False})]


@pytest.mark.parametrize("preset", PRESETS)
def test_second_call_in_the_bucket_compiles_nothing(preset, counter):
    """decode="compiled": the first call compiles each phase graph once, the second (another prompt
    length and max_new_tokens) none, and both give the eager tokens (before: a step per call on
    tensors of the call's exact capacity, so the second call compiled every graph again)."""
    model = _model(preset, counter)
    for i, (ids, kw) in enumerate(_calls()):
        assert torch.equal(model.generate(ids, decode="compiled", **kw), model.generate(ids, **kw)), i
        assert counter.frame_count == GRAPHS[preset], (i, counter.frame_count)
    assert len(model.model._decode_graphs.steps) == 1


def test_second_call_in_the_bucket_captures_nothing(fake_cuda_graphs):
    """decode="cudagraph" (``FakeGraph``): three captures in the first call (token, concept, decoder
    graphs), none in the second, whose steps replay the graphs on the buffers it was copied into."""
    model = _model("tiny_concept")
    for i, (ids, kw) in enumerate(_calls()):
        assert torch.equal(model.generate(ids, decode="cudagraph", **kw), model.generate(ids, **kw)), i
        assert fake_cuda_graphs.captures == 3, (i, fake_cuda_graphs.captures)


def test_a_held_state_keeps_its_tensors(fake_cuda_graphs):
    """A returned cache (its state on the step's buffers) continued after another call took the step:
    the continuation equals the eager one (the other call copied it out before overwriting)."""
    model = _model("tiny_concept")
    (a, kw_a), (b, kw_b) = _calls()
    kw_a = dict(kw_a, max_new_tokens=6, return_dict_in_generate=True)
    key = generation_cache_key()
    first = {m: model.generate(a, decode=m, **kw_a) for m in ("eager", "cudagraph")}
    model.generate(b, decode="cudagraph", **kw_b)
    more = dict(kw_a, attention_mask=torch.cat([kw_a["attention_mask"], kw_a["attention_mask"].new_ones(2, 6)], 1))
    got = {m: model.generate(out.sequences, **{key: returned_cache(out)}, **more).sequences
           for m, out in first.items()}
    assert torch.equal(got["cudagraph"], got["eager"])


def test_move_dtype_change_and_release_free_the_steps():
    """``release_decode_graphs()`` and any ``to`` drop the kept steps; decoding then builds new ones."""
    model = _model("tiny")
    (ids, kw), _ = _calls()
    model.generate(ids, decode="static", **kw)
    graphs = model.model._decode_graphs
    assert len(graphs.steps) == 1
    model.release_decode_graphs()
    assert not graphs.steps
    model.generate(ids, decode="static", **kw)
    assert len(graphs.steps) == 1
    model.to(torch.float64)
    assert not graphs.steps
    model.to(torch.float32)
    assert torch.equal(model.generate(ids, decode="static", **kw), model.generate(ids, **kw))


@pytest.mark.parametrize("decode", ["cudagraph", "compiled"])
def test_cuda_graphs_refuse_fp32_on_cuda(decode):
    """CUDA graphs on CUDA need bf16 (torch's fp32 grouped GEMM copies its offsets to the host): one
    line naming the dtype and what to use, before any allocation (before: accepted, and the capture
    failed on the host copy). fp32 stays allowed where nothing is captured."""
    model = build_model("tiny").model
    line = rf"decode='{decode}' on CUDA .* float32 grouped GEMM .* model.to\(torch.bfloat16\)"
    with pytest.raises(ValueError, match=line):
        generation.DecodeState.allocate(model, 1, 8, "cuda", torch.float32, decode=decode)
    assert generation.check_decode(decode, torch.device("cuda"), torch.bfloat16) == decode
    assert generation.check_decode("static", torch.device("cuda"), torch.float32) == "static"
    assert generation.check_decode("compiled", torch.device("cpu"), torch.float32) == "compiled"


def _forced(model, decode: str, ids, am, tokens_BN):
    """Logits [B, N + 1, V] (fp32) of prefill + steps fed ``tokens_BN`` (teacher-forced: the modes'
    logits compared on the same inputs, also after a step where their tokens differ)."""
    B, N = tokens_BN.shape
    with torch.no_grad():
        state = model.start_decoding(B, ids.shape[1] + N + 1, decode=decode)
        logits = [model.prefill(state, ids, attention_mask=am)]
        logits += [model.step(state, tokens_BN[:, i]) for i in range(N)]
    return torch.stack(logits, 1).float()


def test_fp32_tokens_identical_across_modes(counter, fake_cuda_graphs):
    """fp32: eager, static, compiled and cudagraph give the same greedy tokens (docs/performance.md)."""
    model = _model("tiny_concept", counter)
    ids, kw = _calls()[1]
    want = model.generate(ids, **kw)
    for decode in ("static", "compiled", "cudagraph"):
        assert torch.equal(model.generate(ids, decode=decode, **kw), want), decode


@pytest.mark.parametrize("preset", PRESETS)
def test_bf16_modes_differ_by_rounding_only(preset):
    """bf16 (docs/performance.md): the fixed-shape step's logits differ from the eager step's (other
    reduction lengths and orders), by less than bf16 itself differs from fp32 (the same weights),
    so a greedy token can differ only where the eager top-2 logits are that close (a near-tie)."""
    model = _model(preset)
    ids, am = dev(*left_padded(B=3, T=12, pad=4))
    model.to(torch.bfloat16)
    tokens = model.generate(ids, attention_mask=am, max_new_tokens=24, do_sample=False)[:, 12:]  # eager greedy
    ref = _forced(model.float(), "eager", ids, am, tokens)  # fp32 on the bf16 weights
    model.to(torch.bfloat16)
    eager, static = (_forced(model, m, ids, am, tokens) for m in ("eager", "static"))
    bf16_error = (eager - ref).norm()
    assert 0 < (static - eager).norm() <= bf16_error, ((static - eager).norm(), bf16_error)
    top2 = eager.topk(2, -1).values
    differ = static.argmax(-1) != eager.argmax(-1)
    assert ((top2[..., 0] - top2[..., 1])[differ] <= 2 * (eager - ref).abs().amax()).all()


def test_capacity_buckets_hold_the_capacity_with_bounded_waste():
    """Every capacity fits its bucket, which holds at most 1/8 more slots (64 at least); buckets grow
    with the capacity and are few (a handful per power of two)."""
    caps = range(1, 5000)
    buckets = [capacity_bucket(n) for n in caps]
    assert all(n <= b <= max(64, n * 9 / 8) for n, b in zip(caps, buckets))
    assert buckets == sorted(buckets) and len(set(buckets)) <= 8 * 7 + 1


def test_recompile_limit_is_one_line(counter):
    """More kept versions than torch.compile's recompile limit: one error naming the way out, never an
    eager fallback (fullgraph)."""
    model = _model("tiny", counter)
    (ids, kw), _ = _calls()
    with torch._dynamo.config.patch(recompile_limit=1):
        model.generate(ids, decode="compiled", **kw)
        line = r"recompile limit \(1\) reached for whole_graph .*release_decode_graphs"
        with pytest.raises(RuntimeError, match=line):
            model.generate(ids[:1], decode="compiled", **dict(kw, attention_mask=kw["attention_mask"][:1]))


def test_vlm_second_call_reuses_the_step_and_releases():
    """The VLM (a modality carry, image features in the prefill): a second call with another
    ``max_new_tokens`` decodes on the kept step and equals eager; the VLM's ``release_decode_graphs``
    frees it."""
    from test_vlm_model import build, sample_batch
    model = dev(build())
    ids, mask, pixels = dev(sample_batch(model.num_image_tokens))
    for n in (4, 9):
        want = model.generate(ids, pixels, mask, max_new_tokens=n)
        assert torch.equal(model.generate(ids, pixels, mask, max_new_tokens=n, decode="static"), want), n
    graphs = model.language_model.model._decode_graphs
    assert len(graphs.steps) == 1
    model.release_decode_graphs()
    assert not graphs.steps
