"""The serving engine: continuous batching over a slot table of token and concept caches.

Requests wait in a bounded queue (full: ``EngineError`` 429). One scheduler thread loops (``tick``): admit
waiting requests while a slot is free (prefilled in left-padded groups on an eager ``DecodeState``,
prefill.py, each row then copied into a free slot of the slot table, slots.py), run one decode step over
the smallest batch-size bucket holding the active rows, sample the active rows, stream each one's new
text, and free the slots of the rows that finished, were cancelled (a disconnected client) or timed out
(no other row is copied). The step is the fixed-shape step of that bucket (decode_graph.StaticStep on
views of the table's pool): ``decode="eager"`` runs it eagerly (any device); ``decode="graphs"`` captures
each phase once per bucket as CUDA graphs and replays them (CUDA, bf16); the default takes "graphs"
only where the GPU check proved the captured decode (verdict ``decode_cudagraph``; null: "eager").
Admission counts the bytes a request's slot is allocated at (``planned_bytes``): the ConceptMoE's concept
caches hold ~capacity / R slots, so under one budget its pool holds more rows than its matched MoE's.
Besides the step's own boundary read (ConceptMoE), each step reads the device once: the sampled tokens
and the concept caches' lengths (achieved R), which the host needs to stream text.
"""
from __future__ import annotations

import collections
import logging
import threading
import time

import torch

from vlm.modeling.decode_pool import capacity_bucket
from vlm.modeling.generation import DecodeState

from .prefill import groups, prefill
from .request import EngineError, Request
from .sampling import sample_rows
from .slots import SlotTable, held_bytes, step_mode
from .text_stream import safe_len, stop_at

log = logging.getLogger(__name__)


def language_model(model):
    """The causal LM inside ``model`` (a VLM's ``language_model``, or the model itself)."""
    return getattr(model, "language_model", model)


def planned_state(model, capacity: int) -> DecodeState:
    """One request's caches as a slot of the engine's table allocates them, on the meta device: token
    layers at ``capacity_bucket(capacity)`` slots, concept layers at that / R + headroom."""
    lm = language_model(model)
    return DecodeState.allocate(lm.model, 1, capacity_bucket(capacity), "meta", next(lm.parameters()).dtype)


def planned_bytes(model, capacity: int) -> int:
    """KV bytes admission counts for one request of ``capacity`` token slots (``planned_state``)."""
    return held_bytes(planned_state(model, capacity))


class Engine:
    """``submit`` requests (thread-safe); ``start`` / ``stop`` the scheduler thread. ``capacity``: token
    slots per row (prompt + new tokens); ``kv_budget``: bytes all rows' caches may hold (None: room for
    ``max_rows`` rows; the slot table holds min(``max_rows``, budget // request bytes) rows); ``max_queue``:
    waiting requests before 429; ``prefill_rows``: requests prefilled together at most (left-padded with
    ``pad_id``, default the tokenizer's); ``decode``: "eager" | "graphs" | None (by verdict), slots.step_mode."""

    def __init__(self, model, tokenizer, capacity: int, max_rows: int = 32, max_queue: int = 64,
                 kv_budget: int | None = None, eos_ids=(), prefill_rows: int = 8, pad_id: int | None = None,
                 decode: str | None = None):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.lm = language_model(model)
        self.capacity, self.max_rows, self.max_queue = int(capacity), int(max_rows), int(max_queue)
        p = next(self.lm.parameters())
        mode = step_mode(decode, p.device, p.dtype)
        self.decode = "graphs" if mode == "cudagraph" else "eager"
        self.request_bytes = planned_bytes(model, self.capacity)
        self.kv_budget = int(kv_budget) if kv_budget is not None else self.request_bytes * self.max_rows
        if self.kv_budget < self.request_bytes:
            raise ValueError(f"kv budget {self.kv_budget} B holds no request ({self.request_bytes} B each)")
        self.slots = SlotTable(self.lm.model, self.capacity, min(self.max_rows, self.kv_budget // self.request_bytes),
                               mode)
        self.eos_ids = {int(i) for i in eos_ids}
        if pad_id is None:  # the tokenizer's pad token (padding is masked out)
            pad_id = getattr(tokenizer, "pad_token_id", None) or 0
        self.prefill_rows, self.pad_id = int(prefill_rows), int(pad_id)
        self.waiting: collections.deque[Request] = collections.deque()
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
    def active(self) -> list[Request]:
        """The decoding requests, in slot order."""
        return [r for _, r in self.slots.active]

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.slots.active)

    def held_bytes(self) -> int:
        """Bytes of the active rows' slots (as allocated; 0 when idle)."""
        return len(self.slots.active) * self.row_bytes()

    def allocated_bytes(self) -> int:
        """Bytes of the slot table's pool (every slot, allocated at the first request; grown concept
        caches return to their planned size when the table empties)."""
        return held_bytes(self.slots.pool)

    def row_bytes(self) -> int:
        return self.allocated_bytes() // self.slots.rows

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
                    while not self._stop and not self.waiting and not self.slots.active:
                        self.cond.wait(0.5)
                    if self._stop:
                        break
                self.tick()
        except BaseException as e:  # the thread's failure reaches every caller, never silently
            self.error = e
            for req in [*self.active, *self.waiting]:
                req.emit("error", EngineError(f"engine failure: {type(e).__name__}: {e}", 500, "engine_error"))
            self.slots.reqs = [None] * self.slots.rows
            self.waiting.clear()
            log.exception("vlm.serving engine failed; new requests are refused (503)")

    def tick(self) -> None:
        """One scheduler iteration: admit (prefill, join), then one decode step if any row is active
        (the scheduler thread's loop; tests drive it directly)."""
        self._admit()
        if self.slots.active:
            self.stats["peak_rows"] = max(self.stats["peak_rows"], len(self.slots.active))
            self._step()

    def _token_size(self, rows: list[Request]) -> int:
        """The longest row's token cache length: left padding (a grouped prefill) + prompt + tokens already
        fed (the last sampled one not yet)."""
        return max(r.pad + r.prompt_len + len(r.tokens) - 1 for r in rows)

    @torch.no_grad()
    def _admit(self) -> None:
        """Admit waiting requests while free slots allow (the table's rows: ``max_rows`` within the KV
        budget), prefill them (in groups: prefill.py) and copy the rows that did not finish at their
        first token into free slots."""
        admitted, now = [], time.monotonic()
        with self.cond:
            while self.waiting:
                req = self.waiting[0]
                if req.cancelled or req.expired(now):
                    self.waiting.popleft()
                    self._finish_early(req)
                    continue
                if len(admitted) >= self.slots.free_slots:
                    break
                admitted.append(self.waiting.popleft())
        for group in groups(admitted, self.capacity, self.prefill_rows):
            state, logits_BV = prefill(self.model, self.lm, group, self.capacity, self.pad_id)
            tokens, _ = sample_rows(logits_BV, group)
            for b, r in enumerate(group):
                if not self._emit(r, tokens[b], None):
                    self.slots.join(state, b, r)

    @torch.no_grad()
    def _step(self) -> None:
        """One fixed-shape step over the bucket holding the active rows (empty slots fed the pad token),
        then the active rows sampled and the leaving ones' slots freed."""
        view = self.slots.prepare(self._token_size(self.active))
        active = self.slots.active
        slots, rows = [s for s, _ in active], [r for _, r in active]
        last = [self.pad_id] * view.next_pos_B.shape[0]
        for s, r in active:
            last[s] = r.tokens[-1]
        device = view.next_pos_B.device
        logits_BV = self.lm.step(view, torch.tensor(last, device=device))
        self.slots.stepped(view)
        index_B = torch.tensor(slots, device=device)
        concept_B = view.concept_caches[0].len_B.index_select(0, index_B) if view.concept_caches else None
        tokens, concepts = sample_rows(logits_BV.index_select(0, index_B), rows, concept_B)
        self.recent.append((time.monotonic(), len(rows)))
        now = time.monotonic()
        for i, (s, r) in enumerate(active):
            if self._emit(r, tokens[i], None if concepts is None else concepts[i]):
                self.slots.free(s)
            elif r.cancelled or r.expired(now):
                self._finish_early(r)
                self.slots.free(s)

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
