"""The server with real clients: the official ``openai`` client (plain, streamed, with an image as a data
URL) and N concurrent clients, each getting the greedy answer its request gets alone (fp32), on a tiny
export built here; the KV bytes held return to their idle value (0) afterwards."""
from __future__ import annotations

import concurrent.futures
import time

import pytest
from _eval_helpers import tiny_export
from _serve import data_url, digit_png, load_export, serving

from vlm.serving.engine import Engine
from vlm.serving.server import create_app

N_CLIENTS = 32
KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    return tiny_export(root)


@pytest.fixture(scope="module")
def loaded(export):
    return load_export(export)


@pytest.fixture(scope="module")
def server(loaded, tmp_path_factory):
    model, processor = loaded
    engine = Engine(model, processor.tokenizer, capacity=160, max_rows=N_CLIENTS, max_queue=64).start()
    app = create_app(engine, processor, "tiny", api_key=KEY)
    try:
        with serving(app) as url:
            yield url, engine
    finally:
        engine.stop(drain=False, timeout=30)


def client(url):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def alone(loaded, messages, n):
    """The greedy answer ``generate`` gives this chat alone (the server's prompt: the processor's template)."""
    model, processor = loaded
    from vlm.serving.openai_request import parse_chat
    from vlm.serving.server import prompt_inputs

    turns = parse_chat({"model": "tiny", "messages": messages}, "tiny", None, 1 << 20, 1 << 20).turns
    x = prompt_inputs(processor, turns)
    out = model.generate(input_ids=x["input_ids"], pixel_values=x.get("pixel_values"), max_new_tokens=n,
                         do_sample=False, eos_token_id=model.generation_config.eos_token_id)
    ids = out[0, x["input_ids"].shape[1]:].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    if any(t in eos for t in ids):
        ids = ids[:next(i for i, t in enumerate(ids) if t in eos)]
    return processor.tokenizer.decode(ids, skip_special_tokens=True)


def test_openai_client_plain_streamed_and_image(server, loaded, tmp_path):
    url, _ = server
    c = client(url)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    image = data_url(digit_png(tmp_path))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                             {"type": "text", "text": "What digit is this?"}]}]
    want = alone(loaded, messages, 12)
    plain = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert plain.choices[0].message.content == want
    assert plain.choices[0].finish_reason in ("length", "stop")
    assert plain.usage.completion_tokens <= 12 and plain.usage.prompt_tokens > 16  # the image's tokens count
    chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == want
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    text_only = [{"role": "user", "content": "hello there"}]
    assert c.chat.completions.create(model="tiny", messages=text_only, max_tokens=9,
                                     temperature=0).choices[0].message.content == alone(loaded, text_only, 9)


def test_concurrent_clients_get_their_alone_answers(server, loaded, tmp_path):
    url, engine = server
    image = data_url(digit_png(tmp_path))
    words = ["the cat", "a dog runs", "to be or not", "hello", "what is this", "one two three", "sat on"]
    chats = []
    for i in range(N_CLIENTS):
        content = [{"type": "text", "text": f"{words[i % len(words)]} {i}"}]
        if i % 3 == 0:
            content.insert(0, {"type": "image_url", "image_url": {"url": image}})
        chats.append(([{"role": "user", "content": content}], 4 + i % 9))
    want = [alone(loaded, m, n) for m, n in chats]
    idle = engine.held_bytes()
    assert idle == 0
    c = client(url)

    def ask(i):
        m, n = chats[i]
        if i % 2:
            return c.chat.completions.create(model="tiny", messages=m, max_tokens=n, temperature=0).choices[0].message.content
        stream = c.chat.completions.create(model="tiny", messages=m, max_tokens=n, temperature=0, stream=True)
        return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)

    peak0 = engine.stats["peak_rows"]
    with concurrent.futures.ThreadPoolExecutor(N_CLIENTS) as pool:
        got = list(pool.map(ask, range(N_CLIENTS)))
    assert got == want
    assert engine.stats["peak_rows"] > max(peak0, 1)  # the requests shared decode steps
    for _ in range(200):
        if engine.held_bytes() == idle:
            break
        time.sleep(0.01)
    assert engine.held_bytes() == idle and not engine.active and not engine.waiting
