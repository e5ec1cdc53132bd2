"""A ``POST /v1/chat/completions`` body checked and turned into the processor's chat turns and the engine's
``Params``: every unsupported option is refused with one clear line (400), never ignored."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .images import load_image
from .request import EngineError, Params

ROLES = ("system", "user", "assistant")
# options a client may send that this server does not implement (refused unless at their neutral value)
REFUSED = {"logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []), "functions": (None, []),
           "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}), "logit_bias": (None, {}),
           "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "audio": (None,),
           "modalities": (None, ["text"]), "prediction": (None,)}


def bad(message: str, param: str | None = None, code: str | None = None, status: int = 400) -> EngineError:
    return EngineError(message, status, code, param)


@dataclass
class ChatRequest:
    turns: list  # processor chat turns: {"role", "content": [{"type": "text"|"image", ...}]}
    max_tokens: int | None
    params: Params
    stream: bool
    include_usage: bool


def _number(body: dict, key: str, lo: float, hi: float, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise bad(f"{key} must be a number in [{lo:g}, {hi:g}], got {value!r}", key)
    return float(value)


def _content(content, image_root: Path | None, max_bytes: int, max_pixels: int, where: str) -> list:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or a list of parts", "messages")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            ref = part.get("image_url")
            url = ref.get("url") if isinstance(ref, dict) else ref
            parts.append({"type": "image", "image": load_image(url, image_root, max_bytes, max_pixels)})
        else:
            raise bad(f"{where}.content[{j}]: unsupported part (use {{'type': 'text'}} or {{'type': 'image_url'}})",
                      "messages")
    return parts


def parse_chat(body, model_name: str, image_root: Path | None, max_bytes: int, max_pixels: int,
               default_temperature: float = 1.0) -> ChatRequest:
    """Check ``body`` (the decoded JSON) and load its images; raises ``EngineError`` (4xx).
    ``default_temperature``: when the body gives none (the model's generation config: 0 = greedy)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    if body.get("model") != model_name:
        raise bad(f"the model {body.get('model')!r} does not exist: this server serves {model_name!r}", "model",
                  "model_not_found", 404)
    n = body.get("n", 1)
    if n != 1:
        raise bad(f"n={n!r} is not supported: one choice per request (n = 1)", "n")
    for key, neutral in REFUSED.items():
        if key in body and body[key] not in neutral:
            raise bad(f"{key} is not supported by this server", key)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"messages[{i}]: role must be one of {', '.join(ROLES)}", "messages")
        turns.append({"role": m["role"], "content": _content(m.get("content"), image_root, max_bytes, max_pixels,
                                                             f"messages[{i}]")})
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise bad(f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop must be a string or a list of up to 4 non-empty strings", "stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad(f"seed must be an integer, got {seed!r}", "seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    params = Params(max_tokens=max_tokens or 0, temperature=_number(body, "temperature", 0, 2, default_temperature),
                    top_p=_number(body, "top_p", 1e-9, 1, 1.0), seed=seed, stop=tuple(stop))
    if params.top_p <= 0:
        raise bad("top_p must be > 0", "top_p")
    return ChatRequest(turns, max_tokens, params, stream, bool(isinstance(options, dict) and options.get("include_usage")))
