"""The serving engine (vlm/serving/engine.py): rows that join and leave a running batch decode exactly
what each request decodes alone (greedy, fp32), the KV budget admits by bytes (ConceptMoE more rows
than its matched MoE), the queue bound, cancellation, timeouts and capacity refusals."""
from __future__ import annotations

import time

import pytest
import torch

from vlm.serving.engine import Engine, planned_bytes
from vlm.serving.request import EngineError, Params, Request


class NumberTokenizer:
    """Decodes ids as space-separated numbers (the engine only decodes)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" {i}" for i in ids)


def prompts(n: int, seed: int = 3, vocab: int = 2048):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (1, int(torch.randint(4, 24, (1,), generator=gen))), generator=gen)
            for _ in range(n)]


def alone(model, ids, n: int) -> list[int]:
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def run(engine, reqs, timeout=120.0):
    engine.start()
    try:
        for r in reqs:
            engine.submit(r)
        return [r.collect(timeout) for r in reqs]
    finally:
        engine.stop()


@pytest.mark.parametrize("preset", ["tiny_concept", "tiny"])
def test_rows_joining_and_leaving_decode_as_alone(tiny_model, make_decisive, preset):
    model = tiny_model(preset)
    if preset == "tiny_concept":
        make_decisive(model)
    ids = prompts(7)
    lengths = [5, 12, 3, 9, 12, 1, 7]  # rows leave at different steps; waiting ones join mid-run
    want = [alone(model, x, n) for x, n in zip(ids, lengths)]
    engine = Engine(model, NumberTokenizer(), capacity=64, max_rows=3)
    reqs = [Request(x, None, Params(max_tokens=n)) for x, n in zip(ids, lengths)]
    results = run(engine, reqs)
    assert [r.tokens for r in reqs] == want
    assert [reason for _, reason in results] == ["length"] * 7
    assert engine.stats["peak_rows"] == 3  # batched, not one at a time
    assert engine.held_bytes() == 0 and not engine.active


def test_vlm_rows_with_images_decode_as_alone(make_decisive):
    import tempfile

    from _data_helpers import tiny_tokenizer
    from _eval_helpers import build_tiny_vlm
    from PIL import Image
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tiny_tokenizer(tmp)
        tok = AutoTokenizer.from_pretrained(tmp)
    model, proc = build_tiny_vlm(tok)
    make_decisive(model.language_model)
    inputs = []
    for i, text in enumerate(["hello there", "the cat sat on", "what is this digit", "to be or not"]):
        content = [{"type": "text", "text": text}]
        if i % 2 == 0:
            content.insert(0, {"type": "image", "image": Image.new("RGB", (20, 30), (60 * i, 10, 200))})
        inputs.append(proc.apply_chat_template([{"role": "user", "content": content}], tokenize=True,
                                               return_dict=True, add_generation_prompt=True))
    want = [model.generate(input_ids=x["input_ids"], pixel_values=x.get("pixel_values"), max_new_tokens=8,
                           do_sample=False, eos_token_id=None)[0, x["input_ids"].shape[1]:].tolist() for x in inputs]
    reqs = [Request(x["input_ids"], x.get("pixel_values"), Params(max_tokens=8 - i)) for i, x in enumerate(inputs)]
    run(Engine(model, tok, capacity=96, max_rows=3), reqs)
    assert [r.tokens for r in reqs] == [w[:8 - i] for i, w in enumerate(want)]


def test_budget_admits_more_concept_rows_than_matched_moe(tiny_model):
    concept, moe = tiny_model("tiny_concept"), tiny_model("tiny")
    capacity = 256
    c_bytes, m_bytes = planned_bytes(concept, capacity), planned_bytes(moe, capacity)
    assert c_bytes < m_bytes  # 2 token layers + 2 concept layers at ~capacity / 2, vs 4 token layers
    budget = 4 * m_bytes
    peaks = {}
    for name, model in (("concept", concept), ("moe", moe)):
        engine = Engine(model, NumberTokenizer(), capacity=capacity, max_rows=16, kv_budget=budget)
        run(engine, [Request(x, None, Params(max_tokens=6)) for x in prompts(10)])
        peaks[name] = engine.stats["peak_rows"]
        assert engine.held_bytes() == 0
    assert peaks["moe"] == 4
    assert peaks["concept"] == budget // c_bytes > 4


def test_queue_bound_and_capacity_refusals(tiny_model):
    engine = Engine(tiny_model("tiny"), NumberTokenizer(), capacity=32, max_queue=2)  # not started: nothing drains
    x = prompts(1)[0][:, :8]
    for _ in range(2):
        engine.submit(Request(x, None, Params(max_tokens=4)))
    with pytest.raises(EngineError, match="queue is full") as e:
        engine.submit(Request(x, None, Params(max_tokens=4)))
    assert e.value.status == 429
    with pytest.raises(EngineError, match="context") as e:
        engine.submit(Request(torch.ones(1, 32, dtype=torch.long), None, Params(max_tokens=1)))
    assert e.value.status == 400 and e.value.param == "messages"
    with pytest.raises(EngineError, match="at most 24") as e:
        engine.submit(Request(x, None, Params(max_tokens=25)))
    assert e.value.param == "max_tokens"


def test_cancel_frees_the_row_and_timeout_errors(tiny_model):
    engine = Engine(tiny_model("tiny"), NumberTokenizer(), capacity=512, max_rows=4).start()
    try:
        x = prompts(1)[0]
        long = engine.submit(Request(x, None, Params(max_tokens=400)))
        assert long.events.get(timeout=60)[0] == "delta"
        long.cancel()
        kinds = []
        while not kinds or kinds[-1] not in ("done", "error"):
            kinds.append(long.events.get(timeout=60)[0])
        assert long.finish_reason is None and len(long.tokens) < 400
        for _ in range(500):  # the row leaves at the next step
            if not engine.active:
                break
            time.sleep(0.01)
        assert engine.held_bytes() == 0 and engine.stats["cancelled"] == 1
        late = engine.submit(Request(x, None, Params(max_tokens=400), timeout_s=0.0))
        with pytest.raises(EngineError, match="timed out") as e:
            late.collect(60)
        assert e.value.status == 408
        text, reason = engine.submit(Request(x, None, Params(max_tokens=3))).collect(60)  # still serving
        assert reason == "length" and len(text.split()) == 3
    finally:
        engine.stop(drain=False)


def test_seeded_sampling_reproducible_and_top_p_floor_is_greedy(tiny_model):
    model = tiny_model("tiny")
    x = prompts(1)[0]
    greedy = alone(model, x, 10)

    def sampled(**kw):
        req = Request(x, None, Params(max_tokens=10, **kw))
        run(Engine(model, NumberTokenizer(), capacity=64), [req])
        return req.tokens

    assert sampled(temperature=1.5, seed=7) == sampled(temperature=1.5, seed=7)
    assert sampled(temperature=1.5, seed=7) != sampled(temperature=1.5, seed=8)
    assert sampled(temperature=1.0, top_p=1e-6, seed=1) == greedy


def test_achieved_ratio_of_fixed_boundaries(tiny_model):
    """Fixed boundaries every 2 tokens: the concept caches hold one entry per 2 tokens fed."""
    model = tiny_model("tiny_concept", boundary_mode="fixed")
    engine = Engine(model, NumberTokenizer(), capacity=96, max_rows=4)
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(5, 2048, (1, 16), generator=gen) for _ in range(2)]
    run(engine, [Request(x, None, Params(max_tokens=33)) for x in ids])
    fed = len(ids) * (16 + 32)  # the last sampled token is never fed
    assert engine.stats["fed"] == fed and engine.stats["concepts"] == len(ids) * 24
    assert engine.achieved_ratio() == 2.0


def test_stop_string_ends_the_answer_before_it(tiny_model):
    model = tiny_model("tiny")
    x = prompts(1)[0]
    want = alone(model, x, 8)
    stop = f" {want[3]}"  # NumberTokenizer: the text is " id id id ..."
    full = "".join(f" {t}" for t in want)
    events = []
    engine = Engine(model, NumberTokenizer(), capacity=64).start()
    try:
        engine.submit(Request(x, None, Params(max_tokens=8, stop=(stop,)), sink=events.append))
        for _ in range(1000):
            if events and events[-1][0] != "delta":
                break
            time.sleep(0.01)
    finally:
        engine.stop()
    text = "".join(v for k, v in events if k == "delta")
    assert events[-1] == ("done", "stop")
    assert text == full[:full.index(stop)] and stop not in text


def test_engine_failure_reaches_callers_and_refuses_later_requests(tiny_model):
    model = tiny_model("tiny")
    engine = Engine(model, NumberTokenizer(), capacity=64)

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    engine.lm.step = broken  # the first decode step fails
    engine.start()
    try:
        req = engine.submit(Request(prompts(1)[0], None, Params(max_tokens=4)))
        with pytest.raises(EngineError, match="engine failure: RuntimeError: boom") as e:
            req.collect(60)
        assert e.value.status == 500
        with pytest.raises(EngineError, match="engine failed") as e:
            engine.submit(Request(prompts(1)[0], None, Params(max_tokens=4)))
        assert e.value.status == 503
    finally:
        engine.stop(drain=False, timeout=10)
