"""Bad input and abuse against the server (issue 41 item 5): each an OpenAI-style error body with the right
4xx, nothing logged that leaks the API key or a path outside ``--image-root``, and the server answering
the next good request. A streaming client that disconnects frees its row."""
from __future__ import annotations

import json
import logging
import os
import time

import httpx
import pytest
from _eval_helpers import tiny_export
from _serve import data_url, digit_png, load_export, serving
from PIL import Image

from vlm.serving.engine import Engine
from vlm.serving.server import create_app

KEY = "sk-secret-abcdef987654"
CAPACITY = 96


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_err")
    return load_export(tiny_export(root))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """An image root with a digit and a symlink to a file outside it (and that outside file)."""
    base = tmp_path_factory.mktemp("images")
    root, outside = base / "root", base / "outside"
    root.mkdir()
    outside.mkdir()
    digit_png(root, "ok.png")
    secret = digit_png(outside, "secret.png")
    os.symlink(secret, root / "link.png")
    return root, secret


@pytest.fixture(scope="module")
def server(loaded, files):
    model, processor = loaded
    engine = Engine(model, processor.tokenizer, capacity=CAPACITY, max_rows=4, max_queue=8).start()
    app = create_app(engine, processor, "tiny", api_key=KEY, image_root=files[0], max_image_bytes=20_000,
                     max_image_pixels=256 * 256)
    try:
        with serving(app) as url:
            yield url, engine
    finally:
        engine.stop(drain=False, timeout=30)


def post(url, body, key=KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(f"{url}/v1/chat/completions", content=content, headers={**headers,
                      "Content-Type": "application/json"}, timeout=60)


def chat(content, **kw):
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 3, "temperature": 0, **kw}


def image_part(url):
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "which digit?"}]


def noise_png(path, size):
    Image.frombytes("RGB", (size, size), os.urandom(size * size * 3)).save(path)
    return path


def cases(tmp, secret):
    garbage = "data:image/png;base64," + __import__("base64").b64encode(b"not an image at all").decode()
    return {
        "malformed json": ({"raw": b'{"model": "tiny", "messages": [}'}, 400, "invalid_json"),
        "unknown model": ({"body": {**chat("hi"), "model": "gpt-4o"}}, 404, "model_not_found"),
        "undecodable image": ({"body": chat(image_part(garbage))}, 400, "invalid_image"),
        "not base64": ({"body": chat(image_part("data:image/png;base64,@@@@"))}, 400, "invalid_image"),
        "oversized image bytes": ({"body": chat(image_part(data_url(noise_png(tmp / "big.png", 160))))}, 400,
                                  "invalid_image"),
        "oversized image pixels": ({"body": chat(image_part(data_url(_solid(tmp / "wide.png", 300))))}, 400,
                                   "invalid_image"),
        "absolute path outside root": ({"body": chat(image_part(str(secret)))}, 400, "invalid_image"),
        "file url outside root": ({"body": chat(image_part(f"file://{secret}"))}, 400, "invalid_image"),
        "dot-dot": ({"body": chat(image_part("../outside/secret.png"))}, 400, "invalid_image"),
        "symlink out of root": ({"body": chat(image_part("link.png"))}, 400, "invalid_image"),
        "remote url": ({"body": chat(image_part("https://example.com/cat.png"))}, 400, "invalid_image"),
        "prompt beyond capacity": ({"body": chat("word " * (2 * CAPACITY))}, 400, "context_length_exceeded"),
        "max_tokens 0": ({"body": chat("hi", max_tokens=0)}, 400, None),
        "max_tokens negative": ({"body": chat("hi", max_tokens=-5)}, 400, None),
        "max_tokens huge": ({"body": chat("hi", max_tokens=10**9)}, 400, "context_length_exceeded"),
        "n = 2": ({"body": chat("hi", n=2)}, 400, None),
        "logprobs": ({"body": chat("hi", logprobs=True)}, 400, None),
        "body too large": ({"raw": b" " * (9 * 20_000 + (1 << 20))}, 413, "request_too_large"),
        "missing key": ({"body": chat("hi"), "key": None}, 401, "invalid_api_key"),
        "wrong key": ({"body": chat("hi"), "key": "sk-wrong"}, 401, "invalid_api_key"),
    }


def _solid(path, size):
    Image.new("RGB", (size, size), (10, 200, 10)).save(path)
    return path


def test_each_bad_input_is_an_openai_error_and_the_next_good_request_answers(server, files, tmp_path, caplog,
                                                                              capfd):
    url, _ = server
    _root, secret = files
    caplog.set_level(logging.DEBUG)
    good = chat(image_part("ok.png"))
    assert post(url, good).status_code == 200
    for name, (kwargs, status, code) in cases(tmp_path, secret).items():
        r = post(url, kwargs.get("body"), key=kwargs.get("key", KEY), raw=kwargs.get("raw"))
        assert r.status_code == status, (name, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], name
        assert code is None or err["code"] == code, (name, err)
        assert str(secret.parent) not in r.text and KEY not in r.text, name
        nxt = post(url, good)
        assert nxt.status_code == 200 and nxt.json()["choices"][0]["message"]["role"] == "assistant", name
    out, errs = capfd.readouterr()
    for text in (caplog.text, out, errs):
        assert KEY not in text and str(secret.parent) not in text


def test_flood_beyond_the_queue_is_429_then_served(loaded):
    model, processor = loaded
    engine = Engine(model, processor.tokenizer, capacity=CAPACITY, max_rows=2, max_queue=3)  # started below
    app = create_app(engine, processor, "tiny")
    try:
        with serving(app) as url:
            import concurrent.futures

            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                futures = [pool.submit(post, url, chat("hello", max_tokens=2)) for _ in range(6)]
                for _ in range(500):  # the engine is not running: requests stay queued until it starts
                    if len(engine.waiting) == 3 and sum(f.done() for f in futures) == 3:
                        break
                    time.sleep(0.01)
                refused = [f.result() for f in futures if f.done()]
                assert [r.status_code for r in refused] == [429] * 3
                assert refused[0].json()["error"]["type"] == "rate_limit_error"
                engine.start()
            assert sorted(r.status_code for r in [f.result() for f in futures]) == [200] * 3 + [429] * 3
            assert post(url, chat("hello")).status_code == 200
            metrics = httpx.get(f"{url}/metrics").text
            assert "vlm_requests_rejected_queue_full_total 3" in metrics
    finally:
        engine.stop(drain=False, timeout=30)


def test_disconnecting_stream_frees_its_row(server):
    url, engine = server
    cancelled = engine.stats["cancelled"]
    body = chat("hello there", max_tokens=CAPACITY - 20, stream=True)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    for _ in range(1000):  # the row leaves at the next step after the disconnect
        if engine.stats["cancelled"] > cancelled and not engine.active:
            break
        time.sleep(0.01)
    assert engine.stats["cancelled"] == cancelled + 1 and engine.held_bytes() == 0
    metrics = httpx.get(f"{url}/metrics").text
    assert "vlm_kv_bytes_held 0" in metrics and "vlm_requests_cancelled_total" in metrics
    allocated = engine.allocated_bytes()  # the pool stays allocated after the row left: a gauge of its own
    assert allocated > 0 and f"\nvlm_kv_bytes_allocated {allocated}\n" in metrics
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
