"""Streaming (`type: webdataset`) sources inside a mixture: resumable per-reader streams of shards.

The mixture schedule decides which source the n-th position comes from; a stream source hands out
its next record. Rank r of W with N readers (N = max(1, num_workers): one per DataLoader worker)
owns readers g = r * N + s, s in [0, N); batch b of the rank (b = local position // batch size) is
built by reader s = b mod N, which is exactly the worker the DataLoader gives that batch (it deals
batches round-robin), so each reader lives in one process. Reader g of S = W * N reads the shards
`g, g + S, g + 2S, ...` of each epoch's shard order (`WebDatasetShards.epoch_order`: sorted, then
shuffled with seed + epoch), then moves to the next epoch on its own: each reader sees each of its
shards once per epoch; epochs are not synchronised between readers. The order of a stream source
depends on (seed, world size, num_workers).

State of one reader: `{"epoch", "shard", "offset", "read"}` = the epoch, the index of the current
shard among the reader's shards of that epoch, the records already taken from it (a damaged
shard's final Skip counts as one) and the total taken. Each batch carries the state of its reader
after it was built; the loader keeps the state of the last batch it yielded per reader, so a
checkpoint names exactly the records consumed. Resume (same world size, same N): reopen the shard
and pass over `offset` raw members undecoded: the same records as an uninterrupted run.

Another world size or N: the split changes, so positions are kept at epoch granularity. Every
new reader of a source starts epoch e_min (the lowest epoch among the readers in the state this
rank received) at its first shard. Bound: the part of epoch e_min already read is read again (at
most one epoch of that source), and from epoch e_min on every shard is read once per epoch; an old
reader that was still in an earlier epoch leaves the rest of that epoch unread (those records come
again in epoch e_min). A log line (warning) says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from vlm.modeling.image_transform import DEFAULT_MAX_PIXELS
from .webdataset_shards import WebDatasetShards

log = logging.getLogger(__name__)


class WebDatasetSource:
    """A `type: webdataset` mixture source: the shard list and record decoding. No length."""

    is_stream = True

    def __init__(self, path: str, name: str | None = None, caption_prompt: str | None = None,
                 max_image_pixels: int = DEFAULT_MAX_PIXELS, check_end_marker: bool = True):
        self.path = str(path)
        self.name = name or "webdataset"
        self.shards = WebDatasetShards(self.path, name=self.name, max_image_pixels=max_image_pixels,
                                       caption_prompt=caption_prompt or "Describe the image.",
                                       check_end_marker=check_end_marker)

    def check_readers(self, readers: int) -> None:
        """One line if some reader would get no shard (every reader needs one per epoch)."""
        if len(self.shards.shards) < readers:
            raise ValueError(f"webdataset source {self.name!r} ({self.path}) has {len(self.shards.shards)} "
                             f"shards for {readers} readers (world size x max(1, data.num_workers)): "
                             f"every reader needs at least one shard; write more, smaller shards")


def fresh_state() -> dict:
    return {"epoch": 0, "shard": 0, "offset": 0, "read": 0}


class StreamReader:
    """Reader `reader` of `readers` over one source: next() -> (record or Skip, "<shard>#<index>")."""

    def __init__(self, source: WebDatasetSource, reader: int, readers: int, seed: int, shuffle: bool,
                 state: dict | None = None):
        self.source, self.reader, self.readers = source, reader, readers
        self.seed, self.shuffle = seed, shuffle
        state = dict(state or fresh_state())
        self.epoch, self.shard = int(state["epoch"]), int(state["shard"])
        self.offset, self.read = int(state["offset"]), int(state["read"])
        self._items, self._url = None, None
        self._read_at_epoch_start, self._epochs_without_data = self.read, 0

    def state(self) -> dict:
        return {"epoch": self.epoch, "shard": self.shard, "offset": self.offset, "read": self.read}

    def _my_shards(self) -> list[str]:
        shards = self.source.shards
        order = shards.epoch_order(self.epoch, self.seed) if self.shuffle else list(shards.shards)
        return order[self.reader::self.readers]

    def next(self):
        while True:
            if self._items is None:
                mine = self._my_shards()
                if self.shard >= len(mine):
                    self._next_epoch()
                    continue
                self._url = mine[self.shard]
                self._items = self.source.shards.read_shard(self._url, skip=self.offset)
            item = next(self._items, None)
            if item is None:
                self._items, self.shard, self.offset = None, self.shard + 1, 0
                continue
            where = f"{self._url}#{self.offset}"
            self.offset += 1
            self.read += 1
            return item, where

    def _next_epoch(self) -> None:
        if self.read == self._read_at_epoch_start:
            self._epochs_without_data += 1
            if self._epochs_without_data >= 2:  # a whole epoch of this reader's shards had no member
                raise RuntimeError(f"webdataset source {self.source.name!r}: reader {self.reader} of "
                                   f"{self.readers} read nothing in a whole epoch (its shards are empty)")
        else:
            self._epochs_without_data = 0
        self.epoch, self.shard, self.offset = self.epoch + 1, 0, 0
        self._read_at_epoch_start = self.read


@dataclass
class StreamMark:
    """Appended to a batch's sample list by the mixture: the stream states after building it."""

    reader: int  # global reader id
    states: dict  # source name -> reader state


class MarkedCollate:
    """The collator, plus `batch["stream_state"] = (reader, states)` when the samples end with a mark."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, items):
        mark = None
        if items and isinstance(items[-1], StreamMark):
            mark, items = items[-1], items[:-1]
        batch = self.collator(items)
        if mark is not None:
            batch["stream_state"] = (mark.reader, mark.states)
        return batch


def restore_states(saved: dict | None, names: list[str], rank: int, world_size: int, readers: int) -> dict:
    """The loader's stream states ({source: {str(global reader): state}}) for this rank, from a
    saved loader state (see the module docstring for another world size or reader count)."""
    if not saved or not saved.get("streams"):
        return {}
    same = int(saved.get("world_size", -1)) == world_size and int(saved.get("readers", -1)) == readers
    mine = [str(rank * readers + s) for s in range(readers)]
    out = {}
    for name in names:
        states = saved["streams"].get(name)
        if not states:
            continue
        if same:
            out[name] = {g: dict(states[g]) for g in mine if g in states}
            continue
        e_min = min(int(st["epoch"]) for st in states.values())
        log.warning("[data] stream %r: saved at world size %s x %s readers, now %s x %s: every reader "
                    "restarts epoch %d at its first shard (records of that epoch already read come again)",
                    name, saved.get("world_size"), saved.get("readers"), world_size, readers, e_min)
        out[name] = {g: {**fresh_state(), "epoch": e_min} for g in mine}
    return out
