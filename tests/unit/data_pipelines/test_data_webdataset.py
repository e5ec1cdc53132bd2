"""WebDataset shards: exactly-once split over 2 ranks x 2 workers, epochs, corrupt shards."""

import io
import json
import tarfile
from collections import Counter

import pytest
from PIL import Image
from torch.utils.data import DataLoader

from vlm.modeling.chat_common import Skip
from data_pipelines.webdataset_shards import WebDatasetShards, list_shards


def png_bytes(value: int) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (4, 4), value).save(buf, format="PNG")
    return buf.getvalue()


def add(tar, name, data: bytes):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_shards(folder, n_shards=8, per_shard=5):
    for s in range(n_shards):
        with tarfile.open(folder / f"shard-{s:03d}.tar", "w") as tar:
            for i in range(per_shard):
                key = f"s{s}_{i}"
                add(tar, f"{key}.png", png_bytes(10 * i))
                if i % 2:
                    add(tar, f"{key}.txt", f"caption {key}".encode())
                else:
                    conv = [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": key}]
                    add(tar, f"{key}.json", json.dumps({"conversations": conv}).encode())
    return sorted(folder.glob("*.tar"))


def collect(folder, rank, world_size, workers, epoch=0, **kwargs):
    ds = WebDatasetShards(str(folder), rank=rank, world_size=world_size, seed=3, **kwargs)
    ds.set_epoch(epoch)
    loader = DataLoader(ds, batch_size=None, num_workers=workers)
    return list(loader)


def test_two_ranks_two_workers_each_sample_exactly_once(tmp_path):
    write_shards(tmp_path)
    seen = Counter()
    per_rank = []
    for rank in range(2):
        records = collect(tmp_path, rank, 2, workers=2)
        assert not any(isinstance(r, Skip) for r in records)
        per_rank.append({r["id"] for r in records})
        seen.update(r["id"] for r in records)
    assert len(seen) == 40 and set(seen.values()) == {1}  # all 8 x 5 samples, once each
    assert not per_rank[0] & per_rank[1] and len(per_rank[0]) == len(per_rank[1]) == 20
    one = next(r for r in collect(tmp_path, 0, 1, workers=0) if r["id"].endswith("s0_1"))
    assert one["conversations"][1]["value"] == "caption s0_1" and one["images"][0].mode == "RGB"


def test_epochs_reshuffle_shards_but_keep_exactly_once(tmp_path):
    write_shards(tmp_path)
    orders = []
    for epoch in range(2):
        ids = [r["id"] for rank in range(2) for r in collect(tmp_path, rank, 2, workers=0, epoch=epoch)]
        assert sorted(ids) == sorted(set(ids)) and len(ids) == 40
        orders.append(ids)
    assert orders[0] != orders[1]


@pytest.mark.parametrize("cut", ["member_boundary", "mid_member"])
def test_truncated_shard_is_skipped_and_counted(tmp_path, cut):
    shards = write_shards(tmp_path, n_shards=3, per_shard=6)
    data = shards[1].read_bytes()
    keep = 5 * 1024 if cut == "member_boundary" else 5 * 1024 + 700  # 1 KiB per small member
    shards[1].write_bytes(data[:keep])
    records = collect(tmp_path, 0, 1, workers=0)
    assert [r.reason for r in records if isinstance(r, Skip)] == ["corrupt_shard"]
    ids = {r["id"].split("/")[1] for r in records if not isinstance(r, Skip)}
    assert ids == {f"s{s}_{i}" for s in (0, 2) for i in range(6)}  # the damaged shard is skipped whole


def test_shard_failing_mid_stream_keeps_complete_samples(tmp_path):
    shards = write_shards(tmp_path, n_shards=1, per_shard=6)
    shards[0].write_bytes(shards[0].read_bytes()[: 5 * 1024 + 700])  # cut inside s0_2.json's data
    records = collect(tmp_path, 0, 1, workers=0, check_end_marker=False)
    assert isinstance(records[-1], Skip) and records[-1].reason == "corrupt_shard"
    assert [r["id"].split("/")[1] for r in records[:-1]] == ["s0_0", "s0_1"]  # complete ones only


def test_bad_samples_are_skipped(tmp_path):
    with tarfile.open(tmp_path / "bad.tar", "w") as tar:
        add(tar, "a.png", png_bytes(1))                      # no caption
        add(tar, "b.txt", b"caption without image")
        add(tar, "c.png", b"not a png")
        add(tar, "c.txt", b"caption")
        add(tar, "d.png", png_bytes(2))
        add(tar, "d.txt", b"bad \xff utf8")
        add(tar, "e.png", png_bytes(3))
        add(tar, "e.json", b"{broken")
    reasons = [r.reason for r in collect(tmp_path, 0, 1, workers=0)]
    assert reasons == ["missing_key", "missing_image", "corrupt_image", "non_utf8", "bad_json_line"]


def test_list_shards_patterns(tmp_path):
    shards = write_shards(tmp_path, n_shards=3, per_shard=1)
    assert list_shards(str(tmp_path)) == [str(s) for s in shards]
    assert list_shards(str(tmp_path / "shard-{000..002}.tar")) == [str(s) for s in shards]
    with pytest.raises(FileNotFoundError):
        WebDatasetShards(str(tmp_path / "none-*.tar"))
