"""The OpenAI-compatible HTTP server (FastAPI): ``POST /v1/chat/completions`` (plain, or ``stream: true``
as server-sent events of ``chat.completion.chunk`` objects ending with ``data: [DONE]``), ``GET
/v1/models``, ``/health`` and ``/metrics`` (Prometheus text), on the engine (engine.py). Errors are
OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``, with a 4xx / 5xx status. With an API
key, ``/v1/*`` needs ``Authorization: Bearer <key>`` (compared in constant time, never logged)."""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from pathlib import Path

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from .metrics import prometheus_text
from .openai_request import parse_chat
from .request import EngineError, Params, Request


def error_response(e: EngineError) -> JSONResponse:
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    kind = {401: "authentication_error", 429: "rate_limit_error", 404: "invalid_request_error"}.get(e.status, kind)
    return JSONResponse({"error": {"message": str(e), "type": kind, "param": e.param, "code": e.code}},
                        status_code=e.status)


def create_app(engine, processor, model_name: str, api_key: str | None = None, image_root: Path | None = None,
               max_image_bytes: int = 10 << 20, max_image_pixels: int = 4096 * 4096,
               default_temperature: float = 0.0, request_timeout: float | None = None) -> FastAPI:
    app = FastAPI(title="ConceptMoE-VL", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    http_errors: dict[int, int] = {}
    max_body = 8 * max_image_bytes + (1 << 20)  # a few base64 images and the text

    @app.exception_handler(Exception)
    async def unexpected(request: HttpRequest, exc: Exception):  # an OpenAI body, no internals
        return error_response(EngineError(f"internal error ({type(exc).__name__})", 500, "internal_error"))

    @app.middleware("http")
    async def guard(request: HttpRequest, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), api_key.encode()):
                http_errors[401] = http_errors.get(401, 0) + 1
                what = "a wrong API key" if token else "no API key (Authorization: Bearer <key>)"
                return error_response(EngineError(f"unauthorized: {what}", 401, "invalid_api_key"))
        response = await call_next(request)
        if response.status_code >= 400:
            http_errors[response.status_code] = http_errors.get(response.status_code, 0) + 1
        return response

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return JSONResponse({"status": "error"}, status_code=500)
        return {"status": "draining" if engine.draining else "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine, http_errors), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "conceptmoe-vl", "max_model_len": engine.capacity}]}

    @app.post("/v1/chat/completions")
    async def chat(request: HttpRequest):
        try:
            try:
                body = json.loads(await read_body(request, max_body))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise EngineError(f"the request body is not valid JSON ({e.msg if hasattr(e, 'msg') else e})",
                                  400, "invalid_json") from None
            chat = await run_in_threadpool(parse_chat, body, model_name, image_root, max_image_bytes,
                                           max_image_pixels, default_temperature)
            inputs = await run_in_threadpool(prompt_inputs, processor, chat.turns)
            loop, events = asyncio.get_running_loop(), asyncio.Queue()

            def sink(event):
                try:
                    loop.call_soon_threadsafe(events.put_nowait, event)
                except RuntimeError:  # the loop is gone (shutdown): nobody is listening
                    pass

            prompt_len = int(inputs["input_ids"].shape[1])
            max_tokens = chat.max_tokens or max(1, engine.capacity - prompt_len)
            params = Params(max_tokens, chat.params.temperature, chat.params.top_p, chat.params.seed, chat.params.stop)
            req = engine.submit(Request(inputs["input_ids"], inputs.get("pixel_values"), params, sink=sink,
                                        timeout_s=request_timeout))
        except EngineError as e:
            return error_response(e)
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name}
        if chat.stream:
            return StreamingResponse(stream(req, events, meta, chat.include_usage), media_type="text/event-stream")
        return await complete(request, req, events, meta)

    return app


async def read_body(request: HttpRequest, limit: int) -> bytes:
    """The request body, refused (413) past ``limit`` bytes without reading the rest."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise EngineError(f"the request body is larger than {limit} bytes", 413, "request_too_large")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise EngineError(f"the request body is larger than {limit} bytes", 413, "request_too_large")
    return bytes(data)


def prompt_inputs(processor, turns) -> dict:
    """The processor's chat template over ``turns`` (images as PIL), with the generation prompt."""
    try:
        return processor.apply_chat_template(turns, tokenize=True, return_dict=True, add_generation_prompt=True)
    except (ValueError, TypeError, KeyError) as e:  # the template's own refusals (e.g. a role it has no format for)
        raise EngineError(f"the chat could not be formatted: {e}", 400, "invalid_messages", "messages") from None


def usage(req: Request) -> dict:
    return {"prompt_tokens": req.prompt_len, "completion_tokens": len(req.tokens),
            "total_tokens": req.prompt_len + len(req.tokens)}


async def complete(http: HttpRequest, req: Request, events: asyncio.Queue, meta: dict):
    """Wait for the whole answer; a client that disconnects cancels the request (its row leaves)."""
    parts = []
    while True:
        try:
            kind, value = await asyncio.wait_for(events.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                req.cancel()
                return JSONResponse({}, status_code=499)
            continue
        if kind == "delta":
            parts.append(value)
        elif kind == "error":
            return error_response(value)
        else:
            message = {"role": "assistant", "content": "".join(parts)}
            return {**meta, "object": "chat.completion", "system_fingerprint": None,
                    "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": value}],
                    "usage": usage(req)}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def stream(req: Request, events: asyncio.Queue, meta: dict, include_usage: bool):
    """Server-sent events: a role chunk, one chunk per text delta, the finish chunk (and a usage chunk
    when asked), then ``data: [DONE]``. A client that goes away cancels the request (the generator is
    closed: ``finally``), so its row leaves the batch at the next step."""
    base = {**meta, "object": "chat.completion.chunk", "system_fingerprint": None}

    def chunk(delta: dict, finish=None) -> str:
        return _sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

    try:
        yield chunk({"role": "assistant", "content": ""})
        while True:
            kind, value = await events.get()
            if kind == "delta":
                yield chunk({"content": value})
            elif kind == "error":
                yield _sse({"error": {"message": str(value), "type": "server_error", "param": None,
                                      "code": value.code}})
                break
            else:
                yield chunk({}, value)
                if include_usage:
                    yield _sse({**base, "choices": [], "usage": usage(req)})
                break
        yield "data: [DONE]\n\n"
    finally:
        if req.finish_reason is None:
            req.cancel()
