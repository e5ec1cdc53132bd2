"""WebDataset tar shards as a streaming (iterable) torch Dataset, split across ranks AND workers.

Records are the other readers' (`{"id", "conversations", "images"}`, or a Skip; never raises); pass
an `encoder` (e.g. `SampleEncoder`) to get encoded samples. Sample layout and skips: data_pipelines/README.md.
Training reads shards through a mixture (`type: webdataset`, stream_source.py), which uses
`epoch_order` and `read_shard` with its own resumable per-reader split.
"""

from __future__ import annotations

import glob
import json
import os
import random

import webdataset as wds
from torch.utils.data import IterableDataset, get_worker_info

from vlm.modeling.chat_common import JSON_ERRORS, Skip, check_conversation, has_surrogates
from vlm.modeling.image_transform import DEFAULT_MAX_PIXELS, load_image

IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "webp", "bmp")


def list_shards(urls) -> list[str]:
    """A directory, a glob, a brace pattern ("a-{000..009}.tar") or a list -> sorted shard list."""
    if isinstance(urls, (list, tuple)):
        return sorted(str(u) for u in urls)
    urls = str(urls)
    if os.path.isdir(urls):
        return sorted(glob.glob(os.path.join(urls, "*.tar")))
    if any(ch in urls for ch in "*?["):
        return sorted(glob.glob(urls))
    return sorted(wds.shardlists.expand_urls(urls))


def has_end_marker(path: str) -> bool:
    """True if the tar file ends with zero blocks (end-of-archive marker and/or record padding)."""
    size = os.path.getsize(path)
    if size < 1024 or size % 512:
        return False
    with open(path, "rb") as f:
        f.seek(size - 1024)
        return f.read(1024) == bytes(1024)


class WebDatasetShards(IterableDataset):
    """Shards are ordered identically everywhere (sorted, then shuffled per epoch with `seed + epoch`);
    the R x W readers (R ranks, W DataLoader workers per rank) take shards `slot, slot + R*W, ...`
    with `slot = rank * W + worker_id`, so every shard is read exactly once per epoch (use at least
    R x W shards). Call `set_epoch(e)` before each epoch.

    A local shard without the tar end-of-archive marker (Python's tarfile takes a cut at a member
    boundary for a clean end) is skipped whole as `corrupt_shard`; a shard that fails while
    streaming keeps the samples read before the damage.
    """

    def __init__(self, urls, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle_shards: bool = True, caption_prompt: str = "Describe the image.",
                 max_image_pixels: int = DEFAULT_MAX_PIXELS, encoder=None, name: str = "webdataset",
                 check_end_marker: bool = True):
        self.shards = list_shards(urls)
        if not self.shards:
            raise FileNotFoundError(f"no shards found for {urls!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.shuffle_shards, self.caption_prompt = shuffle_shards, caption_prompt
        self.max_image_pixels, self.encoder, self.name = max_image_pixels, encoder, name
        self.check_end_marker = check_end_marker
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def epoch_order(self, epoch: int, seed: int | None = None) -> list[str]:
        """All shards in the order of `epoch` (shuffled with `seed + epoch` when shuffle_shards)."""
        order = list(self.shards)
        if self.shuffle_shards:
            random.Random((self.seed if seed is None else seed) + epoch).shuffle(order)
        return order

    def my_shards(self, worker_id: int = 0, num_workers: int = 1) -> list[str]:
        slots = self.world_size * num_workers
        return self.epoch_order(self.epoch)[self.rank * num_workers + worker_id::slots]

    def __iter__(self):
        info = get_worker_info()
        worker_id, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for url in self.my_shards(worker_id, num_workers):
            for item in self.read_shard(url):
                yield self.encoder(item) if self.encoder is not None else item

    def read_shard(self, url: str, skip: int = 0):
        """The records (or Skips) of one shard, the first `skip` of them passed over undecoded."""
        for i, item in enumerate(self._read_shard(url)):
            if i >= skip:
                yield item if isinstance(item, Skip) else self._to_record(item)

    def _read_shard(self, url: str):
        """Raw webdataset samples (dicts) of one shard, or a final Skip for a damaged shard."""
        if self.check_end_marker and os.path.isfile(url) and not has_end_marker(url):
            yield Skip("corrupt_shard", url, "no tar end-of-archive marker (truncated)")
            return
        errors = []

        def on_error(exn) -> bool:  # stop this shard at the first error; it is counted below
            errors.append(exn)
            return False

        pipeline = wds.DataPipeline(wds.SimpleShardList([url]), wds.tarfile_to_samples(handler=on_error))
        for sample in pipeline:
            # webdataset emits a sample only once the NEXT member (or a clean end of shard) was
            # read, so a sample arriving while no error was seen is complete; one arriving after
            # an error is the partial sample at the damage point and is dropped.
            if errors:
                break
            yield sample
        if errors:
            yield Skip("corrupt_shard", url, f"{type(errors[0]).__name__}: {errors[0]}")

    def _to_record(self, sample: dict):
        key = f"{os.path.basename(sample.get('__url__', '?'))}/{sample.get('__key__', '?')}"
        image_ext = next((ext for ext in IMAGE_EXTENSIONS if ext in sample), None)
        if image_ext is None:
            return Skip("missing_image", key, f"no image member among {sorted(sample)}")
        if "json" in sample:
            try:
                payload = json.loads(sample["json"].decode("utf-8"))
            except UnicodeDecodeError as err:
                return Skip("non_utf8", key, str(err))
            except JSON_ERRORS as err:  # also too deep nesting / too long integer literals
                return Skip("bad_json_line", key, f"{type(err).__name__}: {err}")
            if has_surrogates(payload):  # a JSON "\\ud800" escape: not encodable text
                return Skip("non_utf8", key, "json holds a lone surrogate")
            conversations = payload.get("conversations") if isinstance(payload, dict) else payload
            if conversations is None:
                return Skip("missing_key", key, "json without 'conversations'")
        elif "txt" in sample:
            try:
                caption = sample["txt"].decode("utf-8").strip()
            except UnicodeDecodeError as err:
                return Skip("non_utf8", key, str(err))
            conversations = [{"from": "human", "value": f"<image>\n{self.caption_prompt}"},
                             {"from": "gpt", "value": caption}]
        else:
            return Skip("missing_key", key, "neither .txt caption nor .json conversations")
        problem = check_conversation(conversations, 1, key)
        if problem is not None:
            return problem
        image = load_image(sample[image_ext], self.max_image_pixels, key)
        if isinstance(image, Skip):
            return image
        return {"id": key, "conversations": conversations, "images": [image]}
