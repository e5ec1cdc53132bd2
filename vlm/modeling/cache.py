"""``ConceptCache``: the compressed concept cache as a transformers ``Cache``, so that transformers'
``GenerationMixin.generate`` (greedy, sampling, beam search, streamers, scores) drives our decoding.

It holds one ``DecodeState`` (generation.py: token KV caches, concept KV caches, the chunker's
``ChunkCarry``), allocated by the model's first forward with the cache (the prefill, on the whole
prompt) and continued one token per row by ``decode_step``. It has no per-layer ``layers`` of its own:
transformers' layer-wise operations are replaced here by whole-state ones. ``reorder_cache`` (beam
search) selects rows of EVERY tensor of the state (``select_rows``); ``crop`` is refused, since a
concept may have completed inside the removed tokens.
"""
from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import Cache

from .attention import KVCache
from .decode_pool import detach
from .generation import DecodeState, check_decode


def _select(value, index_B: torch.Tensor, in_place: bool):
    """``value`` with its batch rows taken at ``index_B`` (tensors, KV caches and lists of them);
    ``in_place``: into the same tensors (same batch size)."""
    if value is None:
        return None
    if torch.is_tensor(value):
        rows = value.index_select(0, index_B.to(value.device))
        return value.copy_(rows) if in_place else rows
    if isinstance(value, KVCache):
        for name, tensor in vars(value).items():
            if torch.is_tensor(tensor):  # (the host fields hold for every row: bounds, flags)
                setattr(value, name, _select(tensor, index_B, in_place))
        return value
    if isinstance(value, list):
        return [_select(v, index_B, in_place) for v in value]
    raise TypeError(f"select_rows: cannot select batch rows of a {type(value).__name__}")


def select_rows(state: DecodeState, index_B: torch.Tensor) -> DecodeState:
    """Rows ``index_B`` of every tensor of ``state`` (in place; also returned): beam reordering, or
    ``repeat_interleave`` with a repeated index. A state with a fixed-shape step (``state.runner``,
    decode_graph.py) keeps its buffers: beam reordering copies into them; another batch size detaches
    the state from the step (it adopts the step of its new key at the next token)."""
    in_place = state.runner is not None and index_B.shape[0] == state.next_pos_B.shape[0]
    if state.runner is not None and not in_place:
        detach(state)  # (copies of the step's buffers first: those stay the step's)
    for f in dataclasses.fields(state):
        setattr(state, f.name, _select(getattr(state, f.name), index_B, in_place))
    return state


def state_tensors(state: DecodeState) -> dict[str, torch.Tensor]:
    """Every tensor of ``state`` by a readable name (tests compare states with it)."""
    out = {}
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            key = f"{f.name}[{i}]" if isinstance(value, list) else f.name
            if torch.is_tensor(item):
                out[key] = item
            elif isinstance(item, KVCache):
                out.update({f"{key}.{n}": t for n, t in vars(item).items() if torch.is_tensor(t)})
    return out


class ConceptCache(Cache):
    """One ``DecodeState`` for ``generate``. ``capacity``: token slots per token layer (prompt + new);
    ``decode``: how the steps after the prefill run (generation.DECODE_MODES, decode_graph.py)."""

    def __init__(self, capacity: int, decode: str = "eager"):
        super().__init__(layers=[])
        self.capacity = int(capacity)
        self.decode = check_decode(decode)
        self.state: DecodeState | None = None

    @property
    def started(self) -> bool:
        """Whether the prefill has run (later forwards are single-token ``decode_step``s)."""
        return self.state is not None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Token positions held (prompt columns incl. left padding, then one per decoded token)."""
        return self.state.token_caches[0].size if self.started else 0  # (host: every row at the same slot)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.capacity

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.started:
            select_rows(self.state, beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.started:
            rows = torch.arange(self.state.next_pos_B.shape[0], device=self.state.next_pos_B.device)
            select_rows(self.state, rows.repeat_interleave(repeats))

    def ensure_capacity(self, capacity: int) -> None:
        """Room for ``capacity`` token positions (a continued generation): token KV slots are appended,
        empty; the concept caches (``ConceptKVCache``) grow by themselves when concepts arrive."""
        if capacity <= self.capacity:
            return
        if self.started:
            if self.state.runner is not None:  # new token buffers: the state adopts a step anew
                detach(self.state)
            for kv in self.state.token_caches:
                extra = capacity - kv.capacity
                if extra <= 0:  # (a fixed-shape mode allocates a capacity bucket)
                    continue
                kv.k = torch.cat([kv.k, kv.k.new_zeros(*kv.k.shape[:2], extra, kv.k.shape[3])], 2)
                kv.v = torch.cat([kv.v, kv.v.new_zeros(*kv.v.shape[:2], extra, kv.v.shape[3])], 2)
                kv.valid_BC = torch.cat([kv.valid_BC, kv.valid_BC.new_zeros(kv.valid_BC.shape[0], extra)], 1)
        self.capacity = int(capacity)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError("ConceptCache cannot be cropped: a concept may have completed in the removed tokens")

    def reset(self) -> None:
        self.state = None

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        return int(self.state.next_pos_B.shape[0]) if self.started else -1

    def __repr__(self) -> str:
        return f"ConceptCache(capacity={self.capacity}, seq_length={self.get_seq_length()}, decode={self.decode!r})"
