"""The engine's slot table: the running rows in fixed slots of one pool of caches, decoded by the
fixed-shape step of the smallest batch-size bucket that holds them.

The pool is one ``DecodeState`` of ``rows`` rows (token caches of ``capacity_bucket(capacity)`` slots,
concept caches at their planned size), allocated at the first join. Bucket B (1, 2, 4, ... and
``rows``) is a ``DecodeState`` whose tensors are views of the pool's first B rows (one storage for
all buckets), decoded by its own ``decode_graph.StaticStep`` built in place on those views: mode
"static" runs the fixed-shape phases eagerly, "cudagraph" captures each phase once per bucket and
replays it. A joining request's prefilled row is copied into the lowest free slot (that row only); a
leaving one frees its slot (its lengths reset: no other row is read or written). When the active count
falls to a smaller bucket, the rows in slots past it are copied into free slots below it (the only
copies of running rows); a larger bucket needs no copy (its views hold the rows already). Empty slots
in the bucket decode the pad token: each row attends its own cache only and the MoE is dropless, so
they change no other row; their tokens are never read and their lengths are reset before they could
fill a cache. The concept caches grow in the pool (every bucket's views re-pointed) and return to
their planned size when the table empties.
"""
from __future__ import annotations

import collections

import torch

from vlm.modeling import generation
from vlm.modeling.decode_graph import StaticStep, empty_cache
from vlm.modeling.decode_pool import CARRY, fill_slots, map_tensors
from vlm.modeling.generation import CAPTURED_DTYPE, DecodeState, grown_capacity
from vlm.modeling.verdicts import proven

DECODES = ("eager", "graphs")  # the engine's knob: the fixed-shape step run eagerly, or captured (CUDA)


def step_mode(decode: str | None, device: torch.device, dtype: torch.dtype, table: dict | None = None) -> str:
    """The StaticStep mode of the engine's ``decode`` ("eager" -> "static", "graphs" -> "cudagraph");
    None: "graphs" only on CUDA in bf16 once the GPU check proved the captured decode (verdict
    ``decode_cudagraph``), else "eager". "graphs" where nothing can capture: one ValueError line."""
    if decode is None:
        decode = "graphs" if (device.type == "cuda" and dtype == CAPTURED_DTYPE
                              and proven("decode_cudagraph", table)) else "eager"
    if decode not in DECODES:
        raise ValueError(f"decode={decode!r}: use one of {', '.join(DECODES)}")
    if decode == "eager":
        return "static"
    try:
        generation.check_decode("cudagraph", device, dtype)
    except ValueError:
        if device.type != "cuda":
            raise ValueError(f"decode='graphs' captures the decode step as CUDA graphs: the model is on "
                             f"{device.type} (use decode='eager')") from None
        raise ValueError(f"decode='graphs' on CUDA needs a bfloat16 model (the captured MoE's grouped GEMM), "
                         f"not {str(dtype).removeprefix('torch.')} (use --dtype bfloat16 or decode='eager')") from None
    return "cudagraph"


def buckets(rows: int) -> list[int]:
    """Batch sizes with a step: the powers of two below ``rows``, then ``rows``."""
    out = [1 << i for i in range(rows.bit_length()) if 1 << i < rows]
    return [*out, rows]


def held_bytes(state: DecodeState | None) -> int:
    """Bytes of every cache tensor of ``state`` as allocated (host: from shapes, no device read)."""
    if state is None:
        return 0
    total = 0
    for cache in [*state.token_caches, *state.concept_caches]:
        for value in vars(cache).values():
            if torch.is_tensor(value):
                total += value.numel() * value.element_size()
    return total


class SlotTable:
    """Slots of ``rows`` rows at ``capacity`` token slots each, for ``model`` (the causal LM's backbone);
    ``mode``: "static" or "cudagraph" (``step_mode``). ``reqs[s]``: the request in slot s, or None."""

    def __init__(self, model, capacity: int, rows: int, mode: str):
        self.model, self.capacity, self.rows, self.mode = model, int(capacity), int(rows), mode
        self.buckets = buckets(self.rows)
        self.reqs: list = [None] * self.rows
        self.pool: DecodeState | None = None
        self.views: dict[int, DecodeState] = {}  # bucket -> its state (views of the pool) with its step
        self.bucket = 0  # the bucket the last step ran (0: none yet, or the table emptied)
        self.concept_size = 0  # host bound of every pool row's concept cache length
        self.since_reset = 0  # steps since the empty slots' lengths were reset
        self.moves = collections.deque(maxlen=1024)  # (from bucket, to bucket, rows copied)

    # ---- rows --------------------------------------------------------------------------------
    @property
    def active(self) -> list[tuple[int, object]]:
        return [(s, r) for s, r in enumerate(self.reqs) if r is not None]

    @property
    def free_slots(self) -> int:
        return self.reqs.count(None)

    @torch.no_grad()
    def join(self, state: DecodeState, b: int, req) -> int:
        """Row ``b`` of the prefilled (eager) ``state`` copied into the lowest free slot, for ``req``;
        the slot. Only that slot's tensors are written."""
        if self.pool is None:
            self._allocate(state)
        slot = self.reqs.index(None)
        pool = self.pool
        top = max((c.capacity for c in state.concept_caches), default=0)
        if pool.concept_caches and top > pool.concept_caches[0].capacity:
            self._set_concepts(lambda c: c.grow(top))
        for mine, theirs in zip(pool.token_caches + pool.concept_caches, state.token_caches + state.concept_caches):
            C, room = theirs.capacity, mine.capacity - theirs.capacity
            for name in ("k", "v"):
                row = getattr(mine, name)[slot]
                fill_slots(row, getattr(theirs, name)[b], 1)
                row.narrow(1, C, room).zero_()
            mine.valid_BC[slot].zero_()
            mine.valid_BC[slot, :C].copy_(theirs.valid_BC[b])
            mine.len_B[slot].copy_(theirs.len_B[b])
        for name in CARRY:
            buf, t = getattr(pool, name), getattr(state, name)
            if (buf is None) != (t is None):
                raise ValueError(f"slot table: the prefill's carry field {name} is "
                                 f"{'set' if t is not None else 'unset'} unlike the first request's")
            if t is not None:
                buf[slot].copy_(t[b])
        if state.concept_caches:
            self.concept_size = max(self.concept_size, state.concept_caches[0].size)
        self.reqs[slot] = req
        return slot

    @torch.no_grad()
    def free(self, slot: int) -> None:
        """Slot ``slot`` empty: its lengths reset (its cache is masked out from then on)."""
        self.reqs[slot] = None
        self._reset([slot])
        if not self.active:  # idle: every length zero, grown concept caches back to their planned size
            self._reset(range(self.rows))
            self.concept_size, self.since_reset, self.bucket = 0, 0, 0
            if self.pool.concept_caches and self.pool.concept_caches[0].capacity != self.planned_concepts:
                self._set_concepts(lambda c: _reallocate(c, self.planned_concepts))

    # ---- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def prepare(self, token_size: int) -> DecodeState:
        """The state of the bucket to step next: the smallest holding the active rows (rows past it
        copied down first), its empty slots reset when due, the host bounds set (``token_size``: the
        longest active row's token length)."""
        n = len(self.active)
        B = next(b for b in self.buckets if b >= n)
        high = [s for s, r in self.active if s >= B]
        if high:  # the count fell to a smaller bucket: rows past it move into its free slots
            low = [s for s in range(B) if self.reqs[s] is None][:len(high)]
            self._move(high, low)
        if B != self.bucket:
            self.moves.append((self.bucket, B, len(high)))
            self.bucket = B
            self._reset([s for s in range(self.rows) if self.reqs[s] is None])
            self.since_reset = 0
        elif self.since_reset >= self.reset_every:
            self._reset([s for s in range(B) if self.reqs[s] is None])
            self.since_reset = 0
        concepts = self.pool.concept_caches
        if concepts and self.concept_size >= concepts[0].capacity:  # the pool grows, never a view alone
            new = grown_capacity(concepts[0].capacity, concepts[0].headroom)
            self._set_concepts(lambda c: c.grow(new))
        view = self._view(B)
        for cache in view.token_caches:
            cache.size = max(int(token_size), self.since_reset)
        for cache in view.concept_caches:
            cache.size = self.concept_size
        return view

    def stepped(self, view: DecodeState) -> None:
        """After the step on ``view``: the concept bound from the step's exact lengths."""
        self.since_reset += 1
        if view.concept_caches:
            self.concept_size = view.concept_caches[0].size

    # ---- the pool ----------------------------------------------------------------------------
    def _allocate(self, state: DecodeState) -> None:
        p = state.token_caches[0].k
        pool = DecodeState.allocate(self.model, self.rows, self.capacity, p.device, p.dtype, decode=self.mode)
        for name in CARRY:
            t = getattr(state, name)
            setattr(pool, name, None if t is None else t.new_zeros((self.rows, *t.shape[1:])))
        self.pool = pool
        self.planned_concepts = pool.concept_caches[0].capacity if pool.concept_caches else 0
        smallest = min([pool.token_caches[0].capacity] + [self.planned_concepts] * bool(pool.concept_caches))
        self.reset_every = max(1, smallest // 2)  # an empty row's lengths stay below half of any cache

    def _view(self, B: int) -> DecodeState:
        if B not in self.views:
            pool = self.pool
            view = DecodeState([_rows(c, B) for c in pool.token_caches], [_rows(c, B) for c in pool.concept_caches])
            for name in CARRY:
                t = getattr(pool, name)
                setattr(view, name, None if t is None else t[:B])
            view.decode = self.mode
            StaticStep(self.model, view, in_place=True)  # (sets view.runner)
            self.views[B] = view
        return self.views[B]

    def _set_concepts(self, change) -> None:
        """``change`` applied to every pool concept cache (new tensors), every bucket's views re-pointed
        (its step then re-marks / recaptures the concept graph, as after a growth between steps)."""
        for c in self.pool.concept_caches:
            change(c)
        for B, view in self.views.items():
            for mine, pc in zip(view.concept_caches, self.pool.concept_caches):
                mine.k, mine.v, mine.valid_BC = pc.k[:B], pc.v[:B], pc.valid_BC[:B]

    def _tensors(self) -> list[torch.Tensor]:
        pool = self.pool
        caches = [t for c in pool.token_caches + pool.concept_caches for t in (c.k, c.v, c.valid_BC, c.len_B)]
        return caches + [t for t in (getattr(pool, n) for n in CARRY) if t is not None]

    def _move(self, src: list[int], dst: list[int]) -> None:
        """Rows ``src`` copied into slots ``dst`` (every pool tensor), their requests with them."""
        dev = self.pool.next_pos_B.device
        src_i, dst_i = (torch.tensor(x, dtype=torch.long, device=dev) for x in (src, dst))
        for t in self._tensors():
            t.index_copy_(0, dst_i, t.index_select(0, src_i))
        for s, d in zip(src, dst):
            self.reqs[d], self.reqs[s] = self.reqs[s], None

    def _reset(self, slots) -> None:
        """Lengths, validity and positions of ``slots`` zeroed (their keys are then never attended)."""
        slots = list(slots)
        if not slots or self.pool is None:
            return
        idx = torch.tensor(slots, dtype=torch.long, device=self.pool.next_pos_B.device)
        for c in self.pool.token_caches + self.pool.concept_caches:
            c.len_B.index_fill_(0, idx, 0)
            c.valid_BC.index_fill_(0, idx, False)
        self.pool.next_pos_B.index_fill_(0, idx, 0)


def _rows(cache, B: int):
    """``cache`` over its first ``B`` rows: the same host fields, views of its tensors."""
    return map_tensors(cache, lambda t: t[:B])


def _reallocate(cache, capacity: int) -> None:
    """``cache`` on fresh zero buffers of ``capacity`` slots (every row empty), in place (its length
    tensor kept: the bucket views share it)."""
    fresh = empty_cache(cache, capacity)
    cache.k, cache.v, cache.valid_BC = fresh.k, fresh.v, fresh.valid_BC
    cache.len_B.zero_()
