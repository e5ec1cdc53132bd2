"""The engine's slot table (vlm/serving/slots.py): requests joining and leaving across batch-bucket edges
decode what each decodes alone (greedy, fp32); with the CPU stand-in of CUDA-graph capture each phase of
each bucket's step is captured once and replayed by later requests; a leave copies no other row; the
KV bytes held return to their idle value after a burst that grew the concept caches; the decode knob."""
from __future__ import annotations

import pytest
import torch
from _cuda_on_cpu import CaptureRules
from conftest import decisive, randomise_joint
from test_engine import NumberTokenizer, alone, prompts
from torch.utils._python_dispatch import TorchDispatchMode

from vlm.modeling import decode_graph, generation
from vlm.modeling.decode_graph import StaticStep
from vlm.modeling.verdicts import unmeasured
from vlm.serving.engine import Engine
from vlm.serving.request import Params, Request
from vlm.serving.slots import buckets, step_mode


def drive(engine, waves, until_active=None):
    """Submit each wave of requests, ticking the scheduler (no thread: deterministic) until at most
    ``until_active`` rows are active and one step ran so (before the next wave), then until idle; the
    requests."""
    reqs = []
    for i, wave in enumerate(waves):
        for r in wave:
            engine.submit(r)
        reqs += wave
        last = i == len(waves) - 1
        while engine.busy if last else len(engine.active) > until_active or engine.waiting:
            engine.tick()
        if not last:
            engine.tick()  # a step at that count (the bucket it fits)
    return reqs


def wave(ids, lengths):
    return [Request(x, None, Params(max_tokens=n)) for x, n in zip(ids, lengths)]


@pytest.mark.parametrize("preset", ["tiny_concept", "tiny"])
def test_rows_across_bucket_edges_decode_as_alone(tiny_model, preset):
    """8 slots: six rows (bucket 8) leave down to two (bucket 2: the rows past it copied down), then
    seven more join (back to 8) and leave; every answer equals the request alone, every step was a
    bucket's fixed-shape step (before: one ragged eager batch, concatenated at every join)."""
    model = tiny_model(preset)
    if model.config.chunking:
        decisive(randomise_joint(model), 3)
    ids = prompts(13, seed=11)
    lengths = [3, 4, 30, 5, 28, 2, 6, 9, 12, 3, 20, 7, 15]
    want = [alone(model, x, n) for x, n in zip(ids, lengths)]
    engine = Engine(model, NumberTokenizer(), capacity=64, max_rows=8)
    assert engine.decode == "eager" and engine.slots.buckets == [1, 2, 4, 8]
    reqs = drive(engine, [wave(ids[:6], lengths[:6]), wave(ids[6:], lengths[6:])], until_active=2)
    assert [r.tokens for r in reqs] == want
    moves = [(a, b, n) for a, b, n in engine.slots.moves if a]
    downs = [i for i, (a, b, _) in enumerate(moves) if b < a]
    ups = [i for i, (a, b, _) in enumerate(moves) if b > a]
    assert downs and ups and max(ups) > min(downs), moves  # both ways, growing again after shrinking
    assert any(n for _, _, n in moves), moves  # rows were copied down at some edge
    assert {1, 2, 8} <= set(engine.slots.views)
    for B, view in engine.slots.views.items():
        assert isinstance(view.runner, StaticStep) and view.next_pos_B.shape == (B,)
        assert all(c.static for c in view.token_caches)
    assert engine.held_bytes() == 0 and not engine.active


def test_an_empty_slot_for_longer_than_the_capacity(tiny_model, make_decisive):
    """Three rows kept active (a stream of requests refilling the freed slots) in bucket 4 for more steps
    in a row than the capacity: its fourth slot stays empty all along, decoding the pad token, and its
    lengths are reset before they fill its caches; every answer equals the request alone."""
    model = make_decisive(tiny_model("tiny_concept"))
    engine = Engine(model, NumberTokenizer(), capacity=48, max_rows=4)
    n = 60
    ids = prompts(n, seed=7)
    lengths = [int(x) for x in torch.randint(4, 16, (n,), generator=torch.Generator().manual_seed(1))]
    reqs, run, longest = [], 0, 0
    while len(reqs) < n:
        while len(engine.active) + len(engine.waiting) < 3 and len(reqs) < n:
            reqs.append(engine.submit(Request(ids[len(reqs)], None, Params(max_tokens=lengths[len(reqs)]))))
        engine.tick()
        assert engine.slots.reqs[3] is None
        run = run + 1 if engine.slots.bucket == 4 else 0  # (0: the table emptied, every slot reset)
        longest = max(longest, run)
    while engine.busy:
        engine.tick()
    assert longest > engine.slots.pool.token_caches[0].capacity, longest  # (64: the capacity bucket of 48)
    assert [r.tokens for r in reqs] == [alone(model, r.input_ids, r.params.max_tokens) for r in reqs]


@pytest.fixture
def capture_standin(monkeypatch):
    """"graphs" on the CPU: warm-up runs the phase, ``CaptureRules`` captures it (counted, under the
    rules of a real capture: no host read, no replaced buffer, no fp32 grouped GEMM), replays counted."""
    monkeypatch.setattr(decode_graph, "warm_up", lambda run: run())
    monkeypatch.setattr(decode_graph, "capture", CaptureRules)
    monkeypatch.setattr(generation, "check_decode", lambda decode, device=None, dtype=None: decode)
    monkeypatch.setattr(CaptureRules, "captures", 0)
    replays = []
    monkeypatch.setattr(CaptureRules, "replay", lambda self, _r=CaptureRules.replay: replays.append(1) or _r(self))
    return replays


def test_graphs_capture_once_per_bucket_and_replay_across_requests(tiny_model, capture_standin):
    """bf16 ConceptMoE, decode="graphs" with the capture stand-in: two bursts of requests (rows joining
    and leaving over several buckets); every capture is one phase of one bucket's step, kept (none
    redone), the second burst captures nothing and only replays, and the tokens equal the same
    engine's eager fixed-shape steps (the graphs run the same phases)."""
    model = decisive(randomise_joint(tiny_model("tiny_concept")), 3).to(torch.bfloat16)
    ids = prompts(10, seed=5)
    lengths = [9, 3, 14, 6, 11, 4, 8, 12, 5, 10]
    bursts = [(ids[:5], lengths[:5]), (ids[5:], lengths[5:])]

    def serve(decode):
        engine = Engine(model, NumberTokenizer(), capacity=48, max_rows=4, decode=decode)
        out, captures = [], []
        for x, n in bursts:
            out += [r.tokens for r in drive(engine, [wave(x[:3], n[:3]), wave(x[3:], n[3:])], until_active=1)]
            captures.append(CaptureRules.captures)
        return engine, out, captures

    _, want, none = serve("eager")
    assert none == [0, 0] and not capture_standin
    engine, got, captures = serve("graphs")
    assert got == want
    held = sum(g is not None for v in engine.slots.views.values() for g in v.runner._captured.values())
    assert captures[0] == captures[1] == held == 3 * len(engine.slots.views), (captures, held)  # each phase once
    assert len(engine.slots.views) >= 2
    assert len(capture_standin) > 3 * held  # replayed thereafter


class Ops(TorchDispatchMode):
    """The aten ops run (names)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


COPIES = {"copy_", "index_copy_", "index_select", "index", "cat", "clone", "_to_copy", "gather", "take"}


def test_a_leave_copies_no_other_row(tiny_model, make_decisive):
    """Rows leave one at a time from a bucket of 4: each leave runs no copy op (only its own slot's
    lengths and mask are reset), every pool tensor keeps its storage, and the other rows' caches are
    bitwise what they were (before: every leave selected the kept rows into new tensors)."""
    model = make_decisive(tiny_model("tiny_concept"))
    engine = Engine(model, NumberTokenizer(), capacity=64, max_rows=4)
    reqs = wave(prompts(4, seed=9), [4, 7, 10, 13])
    for r in reqs:
        engine.submit(r)
    table, seen = engine.slots, []
    free = table.free

    def watched(slot):
        pool = table._tensors()
        ptrs = [t.data_ptr() for t in pool]
        others = [s for s, _ in table.active if s != slot]
        before = [t[others].clone() for t in pool]
        with Ops() as ops:
            free(slot)
        assert not COPIES & set(ops.names), ops.names
        assert [t.data_ptr() for t in table._tensors()] == ptrs
        assert all(torch.equal(t[others], b) for t, b in zip(table._tensors(), before))
        seen.append(slot)
    table.free = watched
    while engine.busy:
        engine.tick()
    assert len(seen) == 4 and [r.tokens for r in reqs] == [alone(model, r.input_ids, n)
                                                             for r, n in zip(reqs, [4, 7, 10, 13])]


def test_kv_bytes_return_to_idle_after_a_burst_that_grew_the_concept_caches(tiny_model, monkeypatch):
    """Concept caches planned for R = 16 with 2 slots of headroom grow during a burst (at a join and
    between steps, in the pool: every bucket's views follow); the answers equal each request alone,
    and once the burst is over the rows hold no bytes and the pool is back at its planned size."""
    model = decisive(randomise_joint(tiny_model("tiny_concept", target_ratio=16.0,
                                                **{"runtime.concept_headroom": 2})), 3)
    grown, grow = [], generation.ConceptKVCache.grow
    monkeypatch.setattr(generation.ConceptKVCache, "grow",
                        lambda c, n: grown.append(n > c.capacity) or grow(c, n))
    engine = Engine(model, NumberTokenizer(), capacity=64, max_rows=4)
    ids, lengths = prompts(6, seed=4), [20, 30, 8, 25, 12, 16]
    drive(engine, [wave(ids[:1], [2])])
    idle = engine.allocated_bytes()
    assert idle == engine.slots.rows * engine.request_bytes and engine.held_bytes() == 0
    peak = []
    tick = engine.tick
    monkeypatch.setattr(engine, "tick", lambda: tick() or peak.append((engine.held_bytes(), engine.allocated_bytes())))
    reqs = drive(engine, [wave(ids, lengths)])
    assert [r.tokens for r in reqs] == [alone(model, x, n) for x, n in zip(ids, lengths)]
    assert any(grown) and max(a for _, a in peak) > idle  # the burst grew the pool's concept caches
    assert max(h for h, _ in peak) > 0
    assert engine.held_bytes() == 0 and engine.allocated_bytes() == idle


def test_decode_knob(tiny_model):
    """"graphs" where nothing captures is one line; the default takes the captured step only on CUDA in
    bf16 once the GPU check proved it (a null verdict: eager); an unknown value is one line."""
    with pytest.raises(ValueError, match=r"^decode='graphs' captures the decode step as CUDA graphs: the model "
                                         r"is on cpu \(use decode='eager'\)$"):
        Engine(tiny_model("tiny"), NumberTokenizer(), capacity=32, decode="graphs")
    with pytest.raises(ValueError, match="decode='fast': use one of eager, graphs"):
        step_mode("fast", torch.device("cpu"), torch.float32)
    table = unmeasured()
    cuda = torch.device("cuda")
    assert step_mode(None, cuda, torch.bfloat16, table) == "static"  # not measured: the reference
    table["paths"]["decode_cudagraph"].update(correct=True, faster=True)
    assert step_mode(None, cuda, torch.bfloat16, table) == "cudagraph"
    assert step_mode(None, cuda, torch.float32, table) == "static"  # fp32 cannot capture the MoE
    assert step_mode(None, torch.device("cpu"), torch.bfloat16, table) == "static"
    with pytest.raises(ValueError, match="decode='graphs' on CUDA needs a bfloat16 model"):
        step_mode("graphs", cuda, torch.float32, table)
    assert buckets(1) == [1] and buckets(6) == [1, 2, 4, 6] and buckets(32) == [1, 2, 4, 8, 16, 32]
