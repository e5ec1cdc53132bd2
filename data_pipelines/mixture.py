"""Weighted, deterministic, resumable mixtures of datasets, and the training data loader (`build_loader`).

The global order of sources and of map-style records is a pure function of (seed, position),
independent of the worker count, and O(1) to compute per position, so resuming never iterates to
skip. A stream source (`type: webdataset`, stream_source.py) takes the positions the schedule
gives it and hands out its next record from a per-reader stream whose position is saved.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter, OrderedDict

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .collate import PackingCollator, PadCollator
from vlm.modeling.chat_common import Skip
from .encode import SampleEncoder
from .sources import build_sources, load_data_config
from .stream_source import MarkedCollate, StreamMark, StreamReader, restore_states


class TooMuchBadData(RuntimeError):
    """Raised when the fraction of skipped samples exceeds the configured limit."""


def block_quotas(weights, block_size: int) -> list[int]:
    """Per-dataset counts per block, summing to block_size (largest remainder rounding)."""
    w = np.asarray(weights, dtype=np.float64)
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be >= 0 with a positive sum, got {list(weights)}")
    exact = w / w.sum() * block_size
    quotas = np.floor(exact).astype(int)
    for k in np.argsort(-(exact - quotas), kind="stable")[: block_size - quotas.sum()]:
        quotas[k] += 1
    return quotas.tolist()


class MixtureSchedule:
    """position -> (dataset index, element index), deterministic from the seed.

    1. Positions are grouped in blocks of `block_size`. Each block holds an exact quota per dataset
       (largest-remainder rounding of weight x block_size), shuffled by
       `np.random.default_rng([seed, 0, block])`.
    2. The n-th draw of dataset k (n = k's quota x block + its rank inside the block) reads element
       `perm_{k,e}[n mod len_k]`, epoch e = n // len_k, with
       `perm_{k,e} = np.random.default_rng([seed, 1 + k, e]).permutation(len_k)` (identity when
       shuffle is off): every dataset is visited exactly once per (its own) epoch.
    A stream source has size None: its n-th draw is (k, n) (the stream decides the record).
    """

    def __init__(self, sizes, weights, seed: int = 0, block_size: int = 1000, shuffle: bool = True):
        self.sizes = [None if s is None else int(s) for s in sizes]
        self.seed, self.shuffle = int(seed), bool(shuffle)
        weights = [w if s is None or s > 0 else 0.0 for w, s in zip(weights, self.sizes)]
        self.block_size = int(block_size)
        self.quotas = block_quotas(weights, self.block_size)
        self._blocks, self._perms = OrderedDict(), OrderedDict()

    def _block(self, b: int):
        if b not in self._blocks:
            order = np.repeat(np.arange(len(self.quotas)), self.quotas)
            if self.shuffle or len(self.quotas) > 1:
                order = np.random.default_rng([self.seed, 0, b]).permutation(order)
            rank = np.zeros(len(order), dtype=np.int64)
            seen = Counter()
            for i, k in enumerate(order.tolist()):
                rank[i] = seen[k]
                seen[k] += 1
            self._blocks[b] = (order, rank)
            if len(self._blocks) > 4:
                self._blocks.popitem(last=False)
        return self._blocks[b]

    def _perm(self, k: int, epoch: int):
        if not self.shuffle:
            return None
        if (k, epoch) not in self._perms:
            self._perms[(k, epoch)] = np.random.default_rng([self.seed, 1 + k, epoch]).permutation(self.sizes[k])
            if len(self._perms) > 2 * len(self.sizes):
                self._perms.popitem(last=False)
        return self._perms[(k, epoch)]

    def __call__(self, position: int) -> tuple[int, int]:
        b, r = divmod(int(position), self.block_size)
        order, rank = self._block(b)
        k = int(order[r])
        n = b * self.quotas[k] + int(rank[r])
        if self.sizes[k] is None:
            return k, n
        epoch, offset = divmod(n, self.sizes[k])
        perm = self._perm(k, epoch)
        return k, int(perm[offset]) if perm is not None else offset


def _size(dataset):
    return None if getattr(dataset, "is_stream", False) else len(dataset)


class MixtureDataset(Dataset):
    """Map-style view: dataset[position] = encoded sample (or Skip) at that global position.

    With stream sources, batches are read through `__getitems__` (the DataLoader's batch fetch):
    their stream positions take the batch's reader's next records, and a `StreamMark` with the
    reader's states after the batch ends the sample list (`MarkedCollate` moves it to the batch)."""

    def __init__(self, datasets, weights, encoder, seed: int = 0, block_size: int = 1000,
                 shuffle: bool = True, names=None):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("need one weight per dataset and at least one dataset")
        self.datasets, self.weights, self.encoder = list(datasets), list(weights), encoder
        self.names = list(names) if names else [getattr(d, "name", f"d{i}") for i, d in enumerate(datasets)]
        self.sizes = [_size(d) for d in self.datasets]
        self.streams = [k for k, size in enumerate(self.sizes) if size is None]
        stream_names = [self.names[k] for k in self.streams]
        if len(set(stream_names)) != len(stream_names):
            raise ValueError(f"webdataset sources need distinct names (their positions are saved by name): "
                             f"{stream_names}")
        if not any((n is None or n > 0) and w > 0 for n, w in zip(self.sizes, self.weights)):
            sizes = ", ".join(f"{n}={z} (weight {w})" for n, z, w in zip(self.names, self.sizes, self.weights))
            raise ValueError(f"no records to draw from: every dataset is empty or has weight 0 ({sizes})")
        self.block_size, self.shuffle = block_size, shuffle
        self._setup, self._readers, self._slot = None, {}, None
        self.set_seed(seed)

    def set_seed(self, seed: int) -> None:
        self.seed = int(seed)
        self.schedule = MixtureSchedule(self.sizes, self.weights, self.seed, self.block_size, self.shuffle)

    def __len__(self) -> int:  # nominal: one pass over every map-style dataset; positions go on forever
        return sum(n for n in self.sizes if n is not None)

    def start_streams(self, rank: int, world_size: int, readers: int, batch_size: int, states: dict) -> None:
        """Before each DataLoader (its workers get a copy): where every reader of this rank starts."""
        self._setup = (rank, world_size, readers, batch_size, states)
        self._readers, self._slot = {}, None

    def _encode(self, k: int, record, where: str):
        out = self.encoder(record)
        if isinstance(out, Skip) and not out.where:
            out = dataclasses.replace(out, where=where)
        return out

    def _where(self, k: int, j: int) -> str:
        return f"{getattr(self.datasets[k], 'path', None) or self.names[k]}#{j}"

    def __getitem__(self, position: int):
        k, j = self.schedule(position)
        if k in self.streams:
            raise RuntimeError(f"position {position} belongs to the stream source {self.names[k]!r}: "
                               "stream sources are read a batch at a time (__getitems__, via MixtureLoader)")
        return self._encode(k, self.datasets[k][j], self._where(k, j))

    def __getitems__(self, positions: list[int]) -> list:
        if not self.streams:
            return [self[p] for p in positions]
        if self._setup is None:
            raise RuntimeError("stream sources need MixtureDataset.start_streams (MixtureLoader calls it)")
        rank, world_size, readers, batch_size, _ = self._setup
        slot = (positions[0] // world_size // batch_size) % readers
        if self._slot is not None and slot != self._slot:  # the DataLoader must deal batches round-robin
            raise RuntimeError(f"one process got batches of stream readers {self._slot} and {slot}")
        self._slot = slot
        reader = rank * readers + slot
        out = []
        for p in positions:
            k, j = self.schedule(p)
            if k in self.streams:
                record, where = self._reader(k, reader).next()
                out.append(self._encode(k, record, where))
            else:
                out.append(self._encode(k, self.datasets[k][j], self._where(k, j)))
        out.append(StreamMark(reader, {self.names[k]: self._reader(k, reader).state() for k in self.streams}))
        return out

    def _reader(self, k: int, reader: int) -> StreamReader:
        if k not in self._readers:
            _, world_size, readers, _, states = self._setup
            state = states.get(self.names[k], {}).get(str(reader))
            self._readers[k] = StreamReader(self.datasets[k], reader, world_size * readers, self.seed,
                                            self.shuffle, state)
        return self._readers[k]


class RankBatchSampler:
    """Batches of global positions for one data-parallel rank, starting at a local offset."""

    def __init__(self, batch_size, rank, world_size, start_local: int = 0, num_samples=None):
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.start_local, self.num_samples = start_local, num_samples

    def __iter__(self):
        local = self.start_local
        while True:
            batch = [(local + i) * self.world_size + self.rank for i in range(self.batch_size)]
            if self.num_samples is not None:
                batch = [p for p in batch if p < self.num_samples]
                if not batch:
                    return
            yield batch
            local += self.batch_size


def _worker_init(_worker_id: int) -> None:
    torch.set_num_threads(1)


class MixtureLoader:
    """Iterates collated batches for one rank; resumable via state_dict()/load_state_dict().

    Rank r of W gets positions r, r+W, r+2W, ... (disjoint slices of the global order); DataLoader
    workers fetch, encode and collate one whole batch per task, so the order does not depend on
    num_workers. Batches whose samples were all skipped are not yielded; their skips are added to
    the next yielded batch's `skipped`. Skips are counted per reason; once
    `min_samples_for_bad_check` positions were seen, a skipped fraction above `max_bad_fraction`
    raises TooMuchBadData (stream records and shards count like any other). With stream sources
    the state also holds `readers` (max(1, num_workers)) and `streams` ({source name: {reader:
    position}}, stream_source.py): exact resume needs the same world size and num_workers.
    """

    def __init__(self, dataset: MixtureDataset, collator, batch_size: int, rank: int = 0,
                 world_size: int = 1, num_workers: int = 0, max_bad_fraction: float = 0.01,
                 min_samples_for_bad_check: int = 200, num_samples: int | None = None,
                 prefetch_factor: int | None = None, pin_memory: bool = False, report=None,
                 report_first: int = 3):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        self.dataset, self.collator, self.batch_size = dataset, collator, int(batch_size)
        self.rank, self.world_size, self.num_workers = rank, world_size, num_workers
        self.max_bad_fraction, self.min_samples_for_bad_check = max_bad_fraction, min_samples_for_bad_check
        self.num_samples, self.prefetch_factor, self.pin_memory = num_samples, prefetch_factor, pin_memory
        self.readers = max(1, int(num_workers))  # stream readers of this rank: one per worker
        for k in dataset.streams:
            dataset.datasets[k].check_readers(world_size * self.readers)
        self.stream_states: dict = {}  # source name -> {global reader id: state after its last batch}
        self.local_consumed = 0  # positions of THIS rank already handed out in yielded batches
        self.bad_counts: Counter = Counter()
        self.seen = 0  # positions of this rank processed (kept + skipped)
        # report(line): called for the first `report_first` skips of each reason (id, file#index,
        # detail); None = silent. The trainer sets it on rank 0.
        self.report, self.report_first = report, int(report_first)
        self.reported: Counter = Counter()

    @property
    def seed(self) -> int:
        return self.dataset.seed

    def state_dict(self) -> dict:
        """samples_consumed counts global positions (identical on every rank, which step in
        lockstep); seen / bad_counts are this rank's. Resuming with another world size starts
        each rank at samples_consumed // world_size (exact when the world size is unchanged); stream
        sources then restart at epoch granularity (stream_source.py)."""
        state = {"seed": self.seed, "samples_consumed": self.local_consumed * self.world_size,
                 "world_size": self.world_size, "seen": self.seen, "bad_counts": dict(self.bad_counts)}
        if self.dataset.streams:
            state["readers"] = self.readers
            state["streams"] = {name: {g: dict(st) for g, st in states.items()}
                                for name, states in self.stream_states.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        if int(state["seed"]) != self.dataset.seed:
            self.dataset.set_seed(int(state["seed"]))
        self.local_consumed = int(state["samples_consumed"]) // self.world_size
        self.seen = int(state.get("seen", 0))
        self.bad_counts = Counter(state.get("bad_counts", {}))
        names = [self.dataset.names[k] for k in self.dataset.streams]
        self.stream_states = restore_states(state, names, self.rank, self.world_size, self.readers)

    def _dataloader(self) -> DataLoader:
        sampler = RankBatchSampler(self.batch_size, self.rank, self.world_size,
                                   self.local_consumed, self.num_samples)
        self.dataset.start_streams(self.rank, self.world_size, self.readers, self.batch_size,
                                   {name: dict(states) for name, states in self.stream_states.items()})
        extra = {}
        if self.num_workers > 0:
            extra = {"worker_init_fn": _worker_init, "prefetch_factor": self.prefetch_factor or 2}
        # a private generator, with or without workers: every DataLoader iterator draws its base seed
        # from it, else from the global torch RNG, whose state a checkpoint restores; a resumed run
        # starts a new iterator after the restore and would shift that RNG (the chunker's boundary
        # noise) by one draw against an uninterrupted run
        return DataLoader(self.dataset, batch_sampler=sampler, collate_fn=MarkedCollate(self.collator),
                          num_workers=self.num_workers, pin_memory=self.pin_memory,
                          generator=torch.Generator().manual_seed(self.seed), **extra)

    def __iter__(self):
        pending = Counter()  # skips of batches that ended up empty, reported with the next one
        for batch in self._dataloader():
            # every position of the batch is either in it or counted in `skipped`
            reader, states = batch.pop("stream_state", (None, {}))
            for name, st in states.items():
                self.stream_states.setdefault(name, {})[str(reader)] = st
            positions = batch["num_samples"] + sum(batch["skipped"].values())
            self.local_consumed += positions
            self.seen += positions
            self.bad_counts.update(batch["skipped"])
            self._report(batch.pop("skip_examples", None) or ())
            self._check_bad_fraction()
            pending.update(batch["skipped"])
            if batch["num_samples"] > 0:
                batch["skipped"] = dict(pending)
                pending = Counter()
                yield batch

    def _report(self, skips) -> None:
        if self.report is None:
            return
        for skip in skips:
            n = self.reported[skip.reason]
            if n >= self.report_first:
                continue
            self.reported[skip.reason] = n + 1
            more = (f" (further {skip.reason} skips are only counted)" if n + 1 == self.report_first else "")
            self.report(f"[data] skipped sample, {skip.describe()}{more}")

    def _check_bad_fraction(self) -> None:
        bad = sum(self.bad_counts.values())
        if self.seen >= self.min_samples_for_bad_check and bad > self.max_bad_fraction * self.seen:
            detail = ", ".join(f"{k}={v}" for k, v in self.bad_counts.most_common())
            raise TooMuchBadData(
                f"too much bad data on rank {self.rank}: {bad} of {self.seen} samples skipped "
                f"({bad / self.seen:.2%} > data.max_bad_fraction {self.max_bad_fraction:.2%}): {detail}; "
                f"fix or remove those records, or raise data.max_bad_fraction")


# ----- entry point -----


def build_loader(data_cfg, chat_tokenizer, image_transform, batch_size: int, rank: int = 0,
                 world_size: int = 1, num_workers: int = 0, seed: int = 0) -> MixtureLoader:
    """Build the training loader of one rank from a data config (dict or YAML path).

    Keys: datasets [{name, type: llava_json|text|webdataset, path, image_root?, weight,
    max_image_pixels?, caption_prompt? (webdataset)}], root (base for relative paths),
    max_length (512), packing (true), padding_side ("right"), pad_to_max_length (false),
    max_bad_fraction (0.01), min_samples_for_bad_check (200), block_size (1000), shuffle (true),
    num_samples (null = endless), index_cache_dir (LLaVA record indexes when the data folder is
    not writable; jsonl_index.py).
    """
    cfg = load_data_config(data_cfg)
    max_length = int(cfg.get("max_length", 512))
    datasets, weights, names = build_sources(cfg, chat_tokenizer, max_length)
    mixture = MixtureDataset(datasets, weights, SampleEncoder(chat_tokenizer, image_transform),
                             seed=seed, block_size=int(cfg.get("block_size", 1000)),
                             shuffle=bool(cfg.get("shuffle", True)), names=names)
    padding_side = cfg.get("padding_side", "right")
    if cfg.get("packing", True):
        collator = PackingCollator.from_chat_tokenizer(
            chat_tokenizer, max_length, padding_side=padding_side,
            pad_to_max_length=bool(cfg.get("pad_to_max_length", False)))
    else:
        collator = PadCollator.from_chat_tokenizer(chat_tokenizer, max_length, padding_side=padding_side)
    if num_workers > 0:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are forked
    return MixtureLoader(mixture, collator, batch_size, rank=rank, world_size=world_size,
                         num_workers=num_workers,
                         max_bad_fraction=float(cfg.get("max_bad_fraction", 0.01)),
                         min_samples_for_bad_check=int(cfg.get("min_samples_for_bad_check", 200)),
                         num_samples=cfg.get("num_samples"))
