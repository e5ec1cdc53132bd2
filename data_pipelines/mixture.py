"""Weighted, deterministic, resumable mixtures of datasets, and the training data loader (`build_loader`).

The global sample order is a pure function of (seed, position), independent of the worker count,
and O(1) to compute per position, so resuming never iterates to skip.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter, OrderedDict

import numpy as np
import torch
import yaml
from torch.utils.data import DataLoader, Dataset

from .collate import PackingCollator, PadCollator
from .common import DATASET_TYPES, Skip
from .encode import SampleEncoder
from .images import DEFAULT_MAX_PIXELS
from .llava_json import LlavaJsonDataset
from .text_corpus import TextCorpusDataset


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
    """

    def __init__(self, sizes, weights, seed: int = 0, block_size: int = 1000, shuffle: bool = True):
        self.sizes, self.seed, self.shuffle = [int(s) for s in sizes], int(seed), bool(shuffle)
        weights = [w if s > 0 else 0.0 for w, s in zip(weights, self.sizes)]
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
        epoch, offset = divmod(n, self.sizes[k])
        perm = self._perm(k, epoch)
        return k, int(perm[offset]) if perm is not None else offset


class MixtureDataset(Dataset):
    """Map-style view: dataset[position] = encoded sample (or Skip) at that global position."""

    def __init__(self, datasets, weights, encoder, seed: int = 0, block_size: int = 1000,
                 shuffle: bool = True, names=None):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("need one weight per dataset and at least one dataset")
        self.datasets, self.weights, self.encoder = list(datasets), list(weights), encoder
        self.names = list(names) if names else [getattr(d, "name", f"d{i}") for i, d in enumerate(datasets)]
        if not any(len(d) > 0 and w > 0 for d, w in zip(self.datasets, self.weights)):
            sizes = ", ".join(f"{n}={len(d)} (weight {w})" for n, d, w in zip(self.names, self.datasets, self.weights))
            raise ValueError(f"no records to draw from: every dataset is empty or has weight 0 ({sizes})")
        self.block_size, self.shuffle = block_size, shuffle
        self.set_seed(seed)

    def set_seed(self, seed: int) -> None:
        self.seed = int(seed)
        self.schedule = MixtureSchedule([len(d) for d in self.datasets], self.weights, self.seed,
                                        self.block_size, self.shuffle)

    def __len__(self) -> int:  # nominal: one pass over every dataset; positions go on forever
        return sum(len(d) for d in self.datasets)

    def __getitem__(self, position: int):
        k, j = self.schedule(position)
        out = self.encoder(self.datasets[k][j])
        if isinstance(out, Skip) and not out.where:
            ds = self.datasets[k]
            src = getattr(ds, "path", None) or self.names[k]
            out = dataclasses.replace(out, where=f"{src}#{j}")
        return out


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
    raises TooMuchBadData.
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
        each rank at samples_consumed // world_size (exact when the world size is unchanged)."""
        return {"seed": self.seed, "samples_consumed": self.local_consumed * self.world_size,
                "world_size": self.world_size, "seen": self.seen, "bad_counts": dict(self.bad_counts)}

    def load_state_dict(self, state: dict) -> None:
        if int(state["seed"]) != self.dataset.seed:
            self.dataset.set_seed(int(state["seed"]))
        self.local_consumed = int(state["samples_consumed"]) // self.world_size
        self.seen = int(state.get("seen", 0))
        self.bad_counts = Counter(state.get("bad_counts", {}))

    def _dataloader(self) -> DataLoader:
        sampler = RankBatchSampler(self.batch_size, self.rank, self.world_size,
                                   self.local_consumed, self.num_samples)
        extra = {}
        if self.num_workers > 0:
            extra = {"worker_init_fn": _worker_init, "prefetch_factor": self.prefetch_factor or 2}
        return DataLoader(self.dataset, batch_sampler=sampler, collate_fn=self.collator,
                          num_workers=self.num_workers, pin_memory=self.pin_memory, **extra)

    def __iter__(self):
        pending = Counter()  # skips of batches that ended up empty, reported with the next one
        for batch in self._dataloader():
            # every position of the batch is either in it or counted in `skipped`
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


def load_data_config(data_cfg) -> dict:
    """A dict, a YAML path, or a training config with a `data:` section -> the data dict."""
    if isinstance(data_cfg, (str, os.PathLike)):
        with open(data_cfg, encoding="utf-8") as f:
            data_cfg = yaml.safe_load(f)
    cfg = dict(data_cfg)
    if "datasets" not in cfg and isinstance(cfg.get("data"), dict):
        cfg = dict(cfg["data"])
    if not cfg.get("datasets"):
        raise ValueError("data config needs a non-empty `datasets` list")
    return cfg


def build_sources(cfg: dict, chat_tokenizer, max_length: int):
    """Instantiate the readers named in cfg['datasets'] -> (datasets, weights, names)."""
    root = cfg.get("root")
    resolve = lambda p: p if root is None or os.path.isabs(p) else os.path.join(root, p)
    datasets, weights, names = [], [], []
    for entry in cfg["datasets"]:
        kind, name = entry.get("type"), entry.get("name")
        if kind == "llava_json":
            image_root = entry.get("image_root")
            ds = LlavaJsonDataset(resolve(entry["path"]),
                                  image_root=resolve(image_root) if image_root else None,
                                  max_image_pixels=entry.get("max_image_pixels", DEFAULT_MAX_PIXELS),
                                  name=name)
        elif kind == "text":
            ds = TextCorpusDataset(resolve(entry["path"]), tokenizer=chat_tokenizer.tokenizer,
                                   max_tokens=max_length - 1 - len(chat_tokenizer.bos), name=name)
        else:
            raise ValueError(f"dataset type {kind!r} not supported in a mixture (use one of "
                             f"{DATASET_TYPES}; webdataset shards stream via WebDatasetShards)")
        datasets.append(ds)
        weights.append(float(entry.get("weight", 1.0)))
        names.append(name or ds.name)
    return datasets, weights, names


def build_loader(data_cfg, chat_tokenizer, image_transform, batch_size: int, rank: int = 0,
                 world_size: int = 1, num_workers: int = 0, seed: int = 0) -> MixtureLoader:
    """Build the training loader of one rank from a data config (dict or YAML path).

    Keys: datasets [{name, type: llava_json|text, path, image_root?, weight}], root (base for
    relative paths), max_length (512), packing (true), padding_side ("right"),
    pad_to_max_length (false), max_bad_fraction (0.01), min_samples_for_bad_check (200),
    block_size (1000), shuffle (true), num_samples (null = endless).
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
