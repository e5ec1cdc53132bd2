"""`type: webdataset` in mixtures: weights, split by rank and worker, exact resume, bad samples
counted, another world size, a clear error for too few shards, and the loader's throughput."""

import io
import json
import logging
import time
from collections import Counter

import pytest
import torch
import webdataset as wds
from PIL import Image

from vlm.modeling.chat_template import ChatTokenizer
from vlm.modeling.chat_common import Skip
from vlm.modeling.image_transform import ImageTransform
from data_pipelines.llava_json import LlavaJsonDataset
from data_pipelines.mixture import MixtureDataset, MixtureLoader, TooMuchBadData, build_loader
from data_pipelines.stream_source import WebDatasetSource
from _data_helpers import digit_record, tiny_tokenizer, write_image, write_llava


def png(value: int, size: int = 8) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (size, size), value).save(buf, format="PNG")
    return buf.getvalue()


def write_wds_shards(folder, n_shards=8, per_shard=5, prefix="w", bad=(), size=8):
    """Shards written by webdataset's own TarWriter: `<prefix>{s}_{i}` with a .png and a .txt
    caption (odd i) or a .json conversation (even i); keys in `bad` get an undecodable image."""
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(n_shards):
        with wds.TarWriter(str(folder / f"{prefix}-{s:03d}.tar")) as sink:
            for i in range(per_shard):
                key = f"{prefix}{s}_{i}"
                sample = {"__key__": key, "png": b"not a png" if key in bad else png(10 * i % 250, size)}
                if i % 2:
                    sample["txt"] = f"caption {i}"
                else:
                    sample["json"] = json.dumps({"conversations": [
                        {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": str(i)}]})
                sink.write(sample)
    return sorted(folder.glob("*.tar"))


def record_id(record):
    return record if isinstance(record, Skip) else {"id": record["id"].split("/")[-1]}


class IdCollator:
    """Keeps the ids (a batch of the real collator, without tensors)."""

    def __call__(self, items):
        kept = [x["id"] for x in items if not isinstance(x, Skip)]
        skipped = Counter(x.reason for x in items if isinstance(x, Skip))
        return {"ids": kept, "num_samples": len(kept), "skipped": dict(skipped), "skip_examples": []}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    write_wds_shards(root / "wds", n_shards=8, per_shard=5, bad={"w2_3", "w5_0"})
    write_image(str(root / "a.png"), "L", value=50)
    write_llava(str(root / "vqa.jsonl"), [digit_record(i, "a.png", answer=str(i)) for i in range(11)], jsonl=True)
    return root


def id_loader(root, weights=(0.6, 0.4), rank=0, world_size=1, workers=0, batch_size=3, seed=1, **kwargs):
    sources = [LlavaJsonDataset(str(root / "vqa.jsonl"), name="vqa"),
               WebDatasetSource(str(root / "wds"), name="wds")]
    mixture = MixtureDataset(sources, list(weights), record_id, seed=seed, block_size=50)
    return MixtureLoader(mixture, IdCollator(), batch_size, rank=rank, world_size=world_size,
                         num_workers=workers, max_bad_fraction=kwargs.pop("max_bad_fraction", 0.5), **kwargs)


def take(loader, n):
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == n:
            break
    return out


def ids(batches):
    return [i for b in batches for i in b["ids"]]


def test_weights_and_each_stream_record_once_per_epoch(files):
    """2 ranks x 2 workers = 4 readers of 2 shards each: one epoch = 40 stream records, all once."""
    per_rank = [ids(take(id_loader(files, (0.0, 1.0), rank, 2, workers=2, batch_size=2), 10)) for rank in (0, 1)]
    seen = Counter(per_rank[0] + per_rank[1])
    assert len(seen) == 38 and set(seen.values()) == {1}  # 40 records, 2 of them bad (counted, not kept)
    assert not set(per_rank[0]) & set(per_rank[1])
    mixed = ids(take(id_loader(files, (0.6, 0.4), batch_size=10), 10))
    from_stream = sum(i.startswith("w") for i in mixed)
    assert from_stream + sum(i.startswith("r") for i in mixed) == len(mixed)
    assert abs(from_stream - 40) <= 2  # exact quotas per block of 50 (40 of 100); bad ones missing


@pytest.mark.parametrize("workers, rank, world_size", [(0, 0, 1), (2, 0, 1), (2, 1, 2)])
def test_resume_is_exact(files, workers, rank, world_size):
    reference_loader = id_loader(files, rank=rank, world_size=world_size, workers=workers)
    reference = take(reference_loader, 14)
    first_loader = id_loader(files, rank=rank, world_size=world_size, workers=workers)
    first = take(first_loader, 5)
    state = json.loads(json.dumps(first_loader.state_dict()))  # checkpoints store JSON
    assert state["readers"] == max(1, workers) and "wds" in state["streams"]
    mid_shard = [st for st in state["streams"]["wds"].values() if st["offset"] not in (0, 5)]
    resumed_loader = id_loader(files, rank=rank, world_size=world_size, workers=workers, seed=99)
    resumed_loader.load_state_dict(state)
    resumed = take(resumed_loader, 9)
    assert ids(first + resumed) == ids(reference)
    assert [b["skipped"] for b in first + resumed] == [b["skipped"] for b in reference]
    assert resumed_loader.bad_counts == reference_loader.bad_counts
    assert mid_shard or workers  # with one reader the cut falls inside a shard: offsets are replayed


def test_bad_stream_records_count_toward_the_limit(tmp_path):
    write_wds_shards(tmp_path / "wds", n_shards=2, per_shard=10, bad={f"w{s}_{i}" for s in (0, 1) for i in (1, 2, 3)})
    write_image(str(tmp_path / "a.png"), "L")
    write_llava(str(tmp_path / "vqa.jsonl"), [digit_record(0, "a.png")], jsonl=True)
    loader = id_loader(tmp_path, (0.0, 1.0), batch_size=4, max_bad_fraction=0.2, min_samples_for_bad_check=8)
    with pytest.raises(TooMuchBadData, match="corrupt_image"):
        take(loader, 10)
    assert loader.bad_counts["corrupt_image"] >= 3


def test_another_world_size_restarts_the_epoch(files, caplog):
    loaders = [id_loader(files, (0.0, 1.0), rank, 2, batch_size=2) for rank in (0, 1)]
    for loader in loaders:
        take(loader, 4)  # 8 records of each rank's 20-record epoch
    state = loaders[0].state_dict()
    single = id_loader(files, (0.0, 1.0), batch_size=2)
    with caplog.at_level(logging.WARNING, logger="data_pipelines.stream_source"):
        single.load_state_dict(state)
    assert "restarts epoch 0" in caplog.text
    assert single.local_consumed == state["samples_consumed"]  # map positions: samples_consumed // 1
    bad_before, after = sum(single.bad_counts.values()), []
    for batch in single:  # the next 40 positions: epoch 0 again, whole (the 2 bad records counted)
        after += batch["ids"]
        if single.local_consumed >= state["samples_consumed"] + 40:
            break
    assert len(after) == 38 and len(set(after)) == 38 and sum(single.bad_counts.values()) == bad_before + 2


def test_too_few_shards_is_one_line(files):
    with pytest.raises(ValueError, match="8 shards for 12 readers") as info:
        id_loader(files, rank=0, world_size=3, workers=4)
    assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return ChatTokenizer(tiny_tokenizer(str(tmp_path_factory.mktemp("tok"))), num_image_tokens=2)


def real_cfg(root):
    return {"root": str(root), "max_length": 48, "max_bad_fraction": 0.5, "datasets": [
        {"name": "vqa", "type": "llava_json", "path": "vqa.jsonl", "weight": 0.5},
        {"name": "wds", "type": "webdataset", "path": "wds/w-{000..007}.tar", "weight": 0.5,
         "caption_prompt": "What is shown?"}]}


def test_build_loader_mixture_resume_with_workers(files, chat):
    from test_data_mixture import same

    def run(n, state=None):
        loader = build_loader(real_cfg(files), chat, ImageTransform(8), batch_size=4, num_workers=2, seed=3)
        if state is not None:
            loader.load_state_dict(state)
        return take(loader, n), loader

    reference, _ = run(8)
    first, loader = run(3)
    resumed, _ = run(5, json.loads(json.dumps(loader.state_dict())))
    assert all(same(a, b) for a, b in zip(first + resumed, reference))
    assert all(b["pixel_values"] is not None for b in reference)


def test_webdataset_loader_throughput(tmp_path, chat):
    """Not timed: prints samples/s of a webdataset-only loader (32x32 PNGs, tokenised, packed)."""
    write_wds_shards(tmp_path / "wds", n_shards=8, per_shard=64, size=32)
    cfg = {"root": str(tmp_path), "max_length": 64,
           "datasets": [{"name": "wds", "type": "webdataset", "path": "wds"}]}
    for workers in (0, 2):
        loader = build_loader(cfg, chat, ImageTransform(16), batch_size=16, num_workers=workers)
        start, n = time.perf_counter(), 0
        for batch in take(loader, 24):
            n += batch["num_samples"] + sum(batch["skipped"].values())
        rate = n / (time.perf_counter() - start)
        print(f"\n[throughput] webdataset loader, num_workers={workers}: {n} samples, {rate:.0f} samples/s")
        assert n == 24 * 16 and isinstance(batch["input_ids"], torch.Tensor)


def test_training_config_accepts_webdataset_entries(tmp_path):
    import _train_helpers as helpers
    from vlm.modeling.config_base import ConfigError
    from vlm.config.train import load_train_config

    entry = {"name": "w", "type": "webdataset", "path": "shards-{000..003}.tar", "caption_prompt": "What?"}
    raw = helpers.config(tmp_path, data={"kind": "mixture", "index_cache_dir": str(tmp_path), "datasets": [entry]})
    cfg = load_train_config(helpers.write_config(tmp_path, raw))
    assert cfg.data.datasets[0]["type"] == "webdataset" and cfg.data.index_cache_dir == str(tmp_path)
    raw["data"]["datasets"] = [{**entry, "type": "tfrecord"}]
    with pytest.raises(ConfigError, match=r"data.datasets\[0\].type"):
        load_train_config(helpers.write_config(tmp_path, raw))
