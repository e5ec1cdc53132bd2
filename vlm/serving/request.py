"""One request to the engine: its prompt, sampling parameters, the events it streams back (a thread-safe
sink: a ``queue.Queue`` by default) and the engine's host-side bookkeeping of its row."""
from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass, field

import torch


class EngineError(Exception):
    """A request the engine refuses; ``status`` the HTTP status the server answers with."""

    def __init__(self, message: str, status: int = 400, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


@dataclass
class Params:
    """Sampling parameters (OpenAI's names). temperature 0: greedy."""
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


_ids = itertools.count()


@dataclass
class Request:
    """A prompt (``input_ids`` [1, T], ``pixel_values`` or None) and its ``params``. Events go to ``sink``:
    ("delta", text), then ("done", finish_reason) or ("error", EngineError)."""
    input_ids: torch.Tensor
    pixel_values: torch.Tensor | None
    params: Params
    sink: object = None
    timeout_s: float | None = None
    id: int = field(default_factory=lambda: next(_ids))
    # host bookkeeping, written by the engine thread
    tokens: list = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of ``text`` already streamed
    concepts: int = 0  # concept-cache entries after the last step (the achieved R's denominator)
    fed: int = 0  # tokens through the caches by then (prompt + tokens fed back)
    pad: int = 0  # left padding of its row (a grouped prefill)
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finish_reason: str | None = None

    def __post_init__(self):
        self.events = queue.Queue() if self.sink is None else None
        self._cancel = threading.Event()
        self.generator = torch.Generator().manual_seed(self.params.seed) if self.params.seed is not None else None

    @property
    def prompt_len(self) -> int:
        return int(self.input_ids.shape[1])

    def emit(self, kind: str, value) -> None:
        (self.events.put if self.sink is None else self.sink)((kind, value))

    def cancel(self) -> None:
        """Thread-safe: the engine drops the row before its next step (a disconnected client)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def expired(self, now: float) -> bool:
        return self.timeout_s is not None and now - self.created > self.timeout_s

    def collect(self, timeout: float = 60.0) -> tuple[str, str]:
        """(text, finish_reason) from the default queue sink (tests, in-process callers); raises the
        request's EngineError, or TimeoutError after ``timeout`` seconds without an event."""
        parts = []
        while True:
            kind, value = self.events.get(timeout=timeout)
            if kind == "delta":
                parts.append(value)
            elif kind == "done":
                return "".join(parts), value
            else:
                raise value
