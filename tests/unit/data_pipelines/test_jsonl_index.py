"""The LLaVA record index: built once and reused, rebuilt when stale, safe under concurrent
builders, a cache dir for read-only data, and records identical to the earlier whole-file reader."""

import json
import logging
import multiprocessing as mp
import os

import numpy as np
import pytest

from data_pipelines import jsonl_index
from vlm.modeling.chat_common import JSON_ERRORS, Skip
from data_pipelines.llava_json import LlavaJsonDataset
from _data_helpers import digit_record, session_default_data, write_image, write_llava


class EarlierReader(LlavaJsonDataset):
    """The reader before the index (JSONL scanned line by line, a JSON list loaded whole and
    re-encoded record by record): the reference the indexed reader must reproduce."""

    def __init__(self, path, image_root=None):
        self.path, self.name = str(path), os.path.splitext(os.path.basename(path))[0]
        self.image_root = image_root or os.path.dirname(self.path)
        self.max_image_pixels = 10 ** 8
        with open(path, "rb") as f:
            data = f.read()
        self.is_jsonl = self.path.endswith(".jsonl") or not data.lstrip()[:1] == b"["
        if self.is_jsonl:
            self.blob, starts, pos = data, [], 0
            for line in data.splitlines(keepends=True):
                if line.strip():
                    starts.append((pos, pos + len(line)))
                pos += len(line)
        else:
            encoded = []
            for r in json.loads(data.decode("utf-8", errors="surrogateescape")):
                try:
                    encoded.append(json.dumps(r, ensure_ascii=True).encode("ascii"))
                except (RecursionError, ValueError):
                    encoded.append(b"")
            ends = np.cumsum([len(e) for e in encoded])
            starts = list(zip(ends - [len(e) for e in encoded], ends))
            self.blob = b"".join(encoded)
        self.spans = starts

    def __len__(self):
        return len(self.spans)

    def _raw(self, index):
        start, end = self.spans[index]
        return self.blob[start:end]


def summary(item):
    if isinstance(item, Skip):
        return ("skip", item.reason, item.sample_id)
    return (item["id"], json.dumps(item["conversations"]), [np.asarray(im).tobytes() for im in item["images"]])


TRICKY = [digit_record(0, "a.png"),
          {"id": "brackets", "conversations": [{"from": "human", "value": "[{,]} \"q\" \\ é ✓"},
                                                {"from": "gpt", "value": "], {"}]},
          {"id": 7, "image": ["a.png", "a.png"], "conversations": [
              {"from": "human", "value": "<image><image>"}, {"from": "gpt", "value": "two"}]},
          {"id": "nested", "x": [[[{"a": [1, 2.5e3, None, True]}]]], "conversations": []},
          "not an object", 12, [1, 2], None,
          {"id": "lone", "conversations": [{"from": "human", "value": "\ud800"}, {"from": "gpt", "value": "x"}]},
          {"id": "nokey"}]


@pytest.mark.parametrize("jsonl", [False, True])
def test_same_records_as_the_earlier_reader(tmp_path, jsonl):
    write_image(str(tmp_path / "a.png"), "L", value=30)
    path = str(tmp_path / ("d.jsonl" if jsonl else "d.json"))
    write_llava(path, TRICKY, jsonl=jsonl)
    if jsonl:  # blank lines, a broken line, invalid bytes, no final newline
        with open(path, "ab") as f:
            f.write(b"\n   \n{broken\n" + json.dumps(digit_record(9, None)).encode()[:-2] + b"\xff\"}]}")
    new, old = LlavaJsonDataset(path), EarlierReader(path)
    assert len(new) == len(old) == len(TRICKY) + 2 * jsonl
    assert [summary(new[i]) for i in range(len(new))] == [summary(old[i]) for i in range(len(old))]


def test_same_records_on_the_default_data(tmp_path_factory):
    root = session_default_data(tmp_path_factory)
    path = os.path.join(root, "digits_val.json")
    new = LlavaJsonDataset(path, os.path.join(root, "images"), index_cache_dir=str(tmp_path_factory.mktemp("c")))
    old = EarlierReader(path, os.path.join(root, "images"))
    assert len(new) == len(old) == 540
    assert all(summary(new[i]) == summary(old[i]) for i in range(0, 540, 7))


@pytest.mark.parametrize("blank", [b"\n", b"   \n", b"\r\n", b"\n\n\t\n"])
def test_blank_lines_between_valid_records_keep_both_and_their_spans(tmp_path, blank):
    """Blank lines count toward the byte offset of the records after them (the index skips the
    line, never its bytes)."""
    first, second, third = (json.dumps(digit_record(i, None)).encode() + b"\n" for i in range(3))
    data = first + blank + second + blank + blank + third
    path = tmp_path / "d.jsonl"
    path.write_bytes(data)
    starts = [0, len(first + blank), len(first + blank + second + blank + blank)]
    expected = [(s, s + len(r)) for s, r in zip(starts, (first, second, third))]
    assert jsonl_index.scan_jsonl(str(path)).tolist() == [list(span) for span in expected]
    ds = LlavaJsonDataset(str(path))
    assert len(ds) == 3 and [ds[i]["id"] for i in range(3)] == ["r0", "r1", "r2"]
    assert [ds._raw(i) for i in range(3)] == [first, second, third]


def test_index_is_reused_and_rebuilt_when_stale(tmp_path, caplog):
    path = write_llava(str(tmp_path / "d.jsonl"), [digit_record(i, None) for i in range(5)], jsonl=True)
    before = dict(jsonl_index.STATS)
    with caplog.at_level(logging.INFO, logger="data_pipelines.jsonl_index"):
        first = LlavaJsonDataset(path)
        second = LlavaJsonDataset(path)
    assert first.index_built and not second.index_built and second.index_path == path + ".idx.npy"
    assert jsonl_index.STATS["built"] == before["built"] + 1 and jsonl_index.STATS["loaded"] == before["loaded"] + 1
    assert "built the record index (5 records)" in caplog.text and "reusing the record index" in caplog.text
    assert isinstance(second._starts, np.memmap) or isinstance(second._starts.base, np.memmap)
    # same size, same mtime: only the content differs (the fingerprint hashes it)
    stat = os.stat(path)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data.replace(b'"r0"', b'"q0"'))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    third = LlavaJsonDataset(path)
    assert third.index_built and third[0]["id"] == "q0"
    write_llava(path, [digit_record(i, None) for i in range(3)], jsonl=True)  # shorter file
    fourth = LlavaJsonDataset(path)
    assert fourth.index_built and len(fourth) == 3 and fourth[2]["id"] == "r2"


def test_unwritable_data_folder_uses_the_cache_dir(tmp_path, monkeypatch, caplog):
    path = write_llava(str(tmp_path / "d.json"), [digit_record(i, None) for i in range(4)])
    (tmp_path / "file").write_text("")
    real = jsonl_index.index_locations
    monkeypatch.setattr(jsonl_index, "index_locations",  # next to the data: below a plain file
                        lambda p, c=None: [str(tmp_path / "file" / "d.idx.npy"), real(p, c)[1]])
    cache = str(tmp_path / "cache")
    with caplog.at_level(logging.INFO, logger="data_pipelines.jsonl_index"):
        ds = LlavaJsonDataset(path, index_cache_dir=cache)
        again = LlavaJsonDataset(path, index_cache_dir=cache)
    assert ds.index_built and ds.index_path.startswith(cache) and len(ds) == 4
    assert not again.index_built and again.index_path == ds.index_path
    assert "data folder not writable" in caplog.text and "cache dir" in caplog.text
    monkeypatch.setattr(jsonl_index, "index_locations", lambda p, c=None: [str(tmp_path / "file" / "x.npy")])
    with pytest.raises(OSError, match="index_cache_dir") as info:
        jsonl_index.load_or_build(path, jsonl_index.KIND_JSON_LIST)
    assert "\n" not in str(info.value)


def _build(path, queue):
    ds = LlavaJsonDataset(path)
    queue.put((len(ds), ds[len(ds) - 1]["id"]))


def test_concurrent_builders_are_safe(tmp_path):
    path = write_llava(str(tmp_path / "d.json"), [digit_record(i, None) for i in range(3000)])
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build, args=(path, queue)) for _ in range(4)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    assert results == [(3000, "r2999")] * 4
    assert sorted(os.listdir(tmp_path)) == ["d.json", "d.json.idx.npy"]  # no tmp file left behind
    assert not LlavaJsonDataset(path).index_built


@pytest.mark.parametrize("text, why", [
    ("[1,]", "empty element"), ("[,1]", "empty element"), ("[1] x", "extra data"), ("[1, [2]", "unterminated"),
    ('[{"a": "b}]', "unterminated string"), ("[{} {}]", "Extra data"), ("[tru]", "JSONDecodeError"),
    ("[" + "[" * 100_000, "unterminated")])
def test_invalid_json_lists_raise_one_line(tmp_path, text, why):
    (tmp_path / "bad.json").write_text(text)
    with pytest.raises(ValueError, match=why) as info:
        LlavaJsonDataset(str(tmp_path / "bad.json"))
    assert "bad.json" in str(info.value) and "\n" not in str(info.value)
    try:
        json.loads(text)
    except JSON_ERRORS:
        pass
    else:
        raise AssertionError("the case is valid JSON")


def test_empty_list_and_empty_jsonl(tmp_path):
    (tmp_path / "e.json").write_text(" [ ] \n")
    (tmp_path / "e.jsonl").write_text("")
    assert len(LlavaJsonDataset(str(tmp_path / "e.json"))) == 0
    assert len(LlavaJsonDataset(str(tmp_path / "e.jsonl"))) == 0



@pytest.mark.parametrize("rank", [0, 1])
def test_collective_rank0_builds_then_the_others_load(tmp_path, monkeypatch, rank):
    """torch.distributed stood in for (a real 2-process group costs two torch imports): rank 0
    builds before the barrier, rank 1 only after it, and then loads rank 0's file."""
    import torch.distributed as dist

    path = write_llava(str(tmp_path / "d.jsonl"), [digit_record(i, None) for i in range(50)], jsonl=True)
    events = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: rank)

    def barrier():
        events.append("barrier")
        if rank == 1:  # what rank 0 did meanwhile
            jsonl_index.load_or_build(path, jsonl_index.KIND_JSONL)
            events.append("rank 0 built")
    monkeypatch.setattr(dist, "barrier", barrier)
    before = dict(jsonl_index.STATS)
    ds = LlavaJsonDataset(path, collective_index=True)
    assert events == (["barrier"] if rank == 0 else ["barrier", "rank 0 built"])
    assert ds.index_built == (rank == 0) and len(ds) == 50
    assert jsonl_index.STATS["built"] == before["built"] + 1
