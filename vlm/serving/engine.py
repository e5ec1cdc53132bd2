"""The serving engine: continuous batching over per-row token and concept caches.

Requests wait in a bounded queue (full: ``EngineError`` 429). One scheduler thread loops: admit waiting
requests while the KV budget allows (prefilled in left-padded groups on a ``DecodeState`` of the
engine's token capacity, prefill.py, then joined to the running batch: rows.join_rows), run one decode
step over every active row, sample, stream each row's new text, and drop the rows that finished, were cancelled (a
disconnected client) or timed out (rows.keep_rows). Admission counts the bytes a request's caches are
allocated at (``planned_bytes``): the ConceptMoE's concept caches hold ~capacity / R slots, so under one
budget it admits more rows than its matched MoE. Decode steps run eagerly (fixed-shape captured steps
per batch bucket are not wired here). Each step reads the device once: the sampled tokens and the
concept caches' lengths (achieved R), which the host needs to stream text.
"""
from __future__ import annotations

import collections
import logging
import threading
import time

import torch

from vlm.modeling.generation import DecodeState

from .prefill import groups, prefill
from .request import EngineError, Request
from .rows import held_bytes, join_rows, keep_rows
from .sampling import sample_rows
from .text_stream import safe_len, stop_at

log = logging.getLogger(__name__)


def language_model(model):
    """The causal LM inside ``model`` (a VLM's ``language_model``, or the model itself)."""
    return getattr(model, "language_model", model)


def planned_bytes(model, capacity: int) -> int:
    """KV bytes of one request's caches at ``capacity`` token slots (token layers at capacity, concept
    layers at capacity / R + headroom), from the model's cache layout (allocated on the meta device)."""
    lm = language_model(model)
    p = next(lm.parameters())
    return held_bytes(DecodeState.allocate(lm.model, 1, capacity, "meta", p.dtype))


class Engine:
    """``submit`` requests (thread-safe); ``start`` / ``stop`` the scheduler thread. ``capacity``: token
    slots per row (prompt + new tokens); ``kv_budget``: bytes all rows' caches may hold (None: room for
    ``max_rows`` rows); ``max_queue``: waiting requests before 429; ``prefill_rows``: requests prefilled
    together at most (left-padded with ``pad_id``, default the tokenizer's)."""

    def __init__(self, model, tokenizer, capacity: int, max_rows: int = 32, max_queue: int = 64,
                 kv_budget: int | None = None, eos_ids=(), prefill_rows: int = 8, pad_id: int | None = None):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.lm = language_model(model)
        self.capacity, self.max_rows, self.max_queue = int(capacity), int(max_rows), int(max_queue)
        self.request_bytes = planned_bytes(model, self.capacity)
        self.kv_budget = int(kv_budget) if kv_budget is not None else self.request_bytes * self.max_rows
        if self.kv_budget < self.request_bytes:
            raise ValueError(f"kv budget {self.kv_budget} B holds no request ({self.request_bytes} B each)")
        self.eos_ids = {int(i) for i in eos_ids}
        if pad_id is None:  # the tokenizer's pad token (padding is masked out)
            pad_id = getattr(tokenizer, "pad_token_id", None) or 0
        self.prefill_rows, self.pad_id = int(prefill_rows), int(pad_id)
        self.waiting: collections.deque[Request] = collections.deque()
        self.active: list[Request] = []
        self.state: DecodeState | None = None
        self.cond = threading.Condition()
        self.draining = False  # SIGTERM: no new requests; the waiting and active ones finish
        self._stop = False
        self._thread: threading.Thread | None = None
        self.stats = collections.Counter()  # requests / tokens / rejections, for /metrics
        self.recent = collections.deque(maxlen=256)  # (time, tokens) per step: tokens/s
        self.error: BaseException | None = None

    # ---- public, thread-safe -------------------------------------------------------------------
    def check(self, req: Request) -> None:
        """Refuse what can never run: a prompt or prompt + max_tokens beyond the capacity."""
        if req.prompt_len >= self.capacity:
            raise EngineError(f"the prompt is {req.prompt_len} tokens; this server's context is {self.capacity} "
                              "tokens (prompt + max_tokens)", 400, "context_length_exceeded", "messages")
        room = self.capacity - req.prompt_len
        if req.params.max_tokens > room:
            raise EngineError(f"max_tokens={req.params.max_tokens} with a {req.prompt_len}-token prompt exceeds "
                              f"the context of {self.capacity} tokens (at most {room})", 400,
                              "context_length_exceeded", "max_tokens")

    def submit(self, req: Request) -> Request:
        self.check(req)
        with self.cond:
            if self.error is not None:
                raise EngineError("the engine failed; restart the server", 503, "engine_error")
            if self.draining or self._stop:
                raise EngineError("the server is shutting down", 503, "shutting_down")
            if len(self.waiting) >= self.max_queue:
                self.stats["rejected_queue_full"] += 1
                raise EngineError(f"the request queue is full ({self.max_queue} waiting); retry later", 429,
                                  "queue_full")
            self.waiting.append(req)
            self.stats["requests"] += 1
            self.cond.notify()
        return req

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._run, name="vlm-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop admitting; with ``drain`` the waiting and active requests finish first."""
        with self.cond:
            self.draining = True
            if not drain:
                self._stop = True
            self.cond.notify()
        if drain:
            deadline = None if timeout is None else time.monotonic() + timeout
            while self.busy and (deadline is None or time.monotonic() < deadline):
                time.sleep(0.01)
        with self.cond:
            self._stop = True
            self.cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    def held_bytes(self) -> int:
        """Bytes the active rows' caches hold (as allocated)."""
        return held_bytes(self.state)

    def tokens_per_s(self, window: float = 10.0) -> float:
        now = time.monotonic()
        steps = [(t, n) for t, n in list(self.recent) if now - t <= window]
        if not steps:
            return 0.0
        span = max(now - steps[0][0], 1e-3)
        return sum(n for _, n in steps) / span

    def achieved_ratio(self) -> float:
        """Tokens per concept cache entry over the requests served so far and the active rows (0 before
        any decode step, and without concept caches)."""
        rows = list(self.active)
        concepts = self.stats["concepts"] + sum(r.concepts for r in rows)
        return (self.stats["fed"] + sum(r.fed for r in rows)) / concepts if concepts else 0.0

    # ---- the scheduler thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self._stop and not self.waiting and not self.active:
                        self.cond.wait(0.5)
                    if self._stop:
                        break
                joined = self._admit()
                if joined:
                    self.state = join_rows(([self.state] if self.state is not None else []) + joined,
                                           self._token_size(self.active))
                if self.active:
                    self.stats["peak_rows"] = max(self.stats["peak_rows"], len(self.active))
                    self._step()
        except BaseException as e:  # the thread's failure reaches every caller, never silently
            self.error = e
            for req in [*self.active, *self.waiting]:
                req.emit("error", EngineError(f"engine failure: {type(e).__name__}: {e}", 500, "engine_error"))
            self.active, self.state = [], None
            self.waiting.clear()
            log.exception("vlm.serving engine failed; new requests are refused (503)")

    def _token_size(self, rows: list[Request]) -> int:
        """The longest row's token cache length: left padding (a grouped prefill) + prompt + tokens already
        fed (the last sampled one not yet)."""
        return max(r.pad + r.prompt_len + len(r.tokens) - 1 for r in rows)

    @torch.no_grad()
    def _admit(self) -> list[DecodeState]:
        """Admit waiting requests while rows and KV budget allow, prefill them (in groups: prefill.py);
        the states of the rows that did not finish at their first token."""
        admitted, now = [], time.monotonic()
        with self.cond:
            while self.waiting:
                req = self.waiting[0]
                if req.cancelled or req.expired(now):
                    self.waiting.popleft()
                    self._finish_early(req)
                    continue
                held = self.held_bytes() + len(admitted) * self.request_bytes
                if len(self.active) + len(admitted) >= self.max_rows or held + self.request_bytes > self.kv_budget:
                    break
                admitted.append(self.waiting.popleft())
        states = []
        for group in groups(admitted, self.capacity, self.prefill_rows):
            state, logits_BV = prefill(self.model, self.lm, group, self.capacity, self.pad_id)
            tokens, _ = sample_rows(logits_BV, group)
            keep = [b for b, r in enumerate(group) if not self._emit(r, tokens[b], None)]
            if not keep:
                continue
            if len(keep) < len(group):
                state = keep_rows(state, keep, max(group[b].pad + group[b].prompt_len for b in keep))
            self.active += [group[b] for b in keep]
            states.append(state)
        return states

    @torch.no_grad()
    def _step(self) -> None:
        rows = self.active
        last_B = torch.tensor([r.tokens[-1] for r in rows], device=self.state.next_pos_B.device)
        logits_BV = self.lm.step(self.state, last_B)
        concept_B = self.state.concept_caches[0].len_B if self.state.concept_caches else None
        tokens, concepts = sample_rows(logits_BV, rows, concept_B)
        keep = [b for b, r in enumerate(rows) if not self._emit(r, tokens[b], None if concepts is None else concepts[b])]
        self.recent.append((time.monotonic(), len(rows)))
        now = time.monotonic()
        for b in list(keep):
            if rows[b].cancelled or rows[b].expired(now):
                self._finish_early(rows[b])
                keep.remove(b)
        if len(keep) < len(rows):
            self.active = [rows[b] for b in keep]
            if self.active:
                self.state = keep_rows(self.state, keep, self._token_size(self.active))
            else:
                self.state = None

    def _emit(self, req: Request, token: int, concepts: int | None) -> bool:
        """Record ``token`` (and the row's concept count, host) for ``req``, stream its new text; True when
        the request is finished."""
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        if concepts is not None:  # read after the step that fed the previous token
            req.concepts, req.fed = concepts, req.prompt_len + len(req.tokens)
        self.stats["tokens"] += 1
        done = None
        if token in self.eos_ids:
            done = "stop"
        else:
            req.tokens.append(token)
            req.text = self.tokenizer.decode(req.tokens, skip_special_tokens=True)
            cut = stop_at(req.text, req.params.stop)
            if cut is not None:
                req.text, done = req.text[:cut], "stop"
            elif len(req.tokens) >= req.params.max_tokens:
                done = "length"
        end = len(req.text) if done else safe_len(req.text, req.params.stop)
        if end > req.sent:
            req.emit("delta", req.text[req.sent:end])
            req.sent = end
        if done:
            req.finish_reason = done
            self.stats["finished"] += 1
            self._retire(req)
            req.emit("done", done)
        return done is not None

    def _retire(self, req: Request) -> None:
        """A leaving row's tokens and concepts join the served totals (the achieved R)."""
        self.stats["fed"] += req.fed
        self.stats["concepts"] += req.concepts
        req.fed = req.concepts = 0

    def _finish_early(self, req: Request) -> None:
        self._retire(req)
        if req.cancelled:
            self.stats["cancelled"] += 1
            req.emit("done", "cancelled")
        else:
            self.stats["timed_out"] += 1
            req.emit("error", EngineError(f"the request timed out after {req.timeout_s:g} s", 408, "timeout"))
