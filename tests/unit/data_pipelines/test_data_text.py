"""Text corpus reader: .txt chunking, .jsonl documents, bad bytes, and text-only encoding."""

import json

import pytest

from vlm.modeling.chat_template import ChatTokenizer
from vlm.modeling.chat_common import IGNORE_INDEX, Skip
from _data_helpers import tiny_tokenizer
from data_pipelines.text_corpus import TextCorpusDataset

LINES = [f"Line {i}: to be, or not to be, that is the question." for i in range(200)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def test_txt_chunks_cover_file_in_order(tmp_path, tok):
    text = "\n".join(LINES) + "\n" + "that is the question " * 150 + "\n"  # + one very long line
    path = tmp_path / "c.txt"
    path.write_text(text, encoding="utf-8")
    ds = TextCorpusDataset(str(path), tokenizer=tok, max_tokens=64)
    chunks = [ds[i]["text"] for i in range(len(ds))]
    assert "".join(chunks) == text  # nothing lost, nothing duplicated, order kept
    assert len(ds) > 10
    sizes = [len(tok(c)["input_ids"]) for c in chunks]
    assert max(sizes) <= 64 * 1.25 and sum(sizes) / len(sizes) > 64 * 0.5  # ~max_tokens each
    assert all(c.endswith("\n") for c in chunks if c.startswith("Line"))  # whole lines


def test_exact_counts_never_overflow(tmp_path, tok):
    path = tmp_path / "c.txt"
    path.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    ds = TextCorpusDataset(str(path), tokenizer=tok, max_tokens=50, exact_counts=True)
    assert max(len(tok(ds[i]["text"])["input_ids"]) for i in range(len(ds))) <= 52


def test_txt_non_utf8_chunk_skipped_and_nul_cleaned(tmp_path):
    data = b"good line one\n" * 3 + b"bad \xff\xfe bytes\n" + b"nul\x00 inside\n"
    path = tmp_path / "b.txt"
    path.write_bytes(data)
    ds = TextCorpusDataset(str(path), max_tokens=4, chars_per_token=4.0)  # ~1 line per chunk
    items = [ds[i] for i in range(len(ds))]
    skips = [x for x in items if isinstance(x, Skip)]
    assert [s.reason for s in skips] == ["non_utf8"]
    texts = [x["text"] for x in items if not isinstance(x, Skip)]
    assert "nul inside\n" in texts and not any("\x00" in t for t in texts)


def test_jsonl_documents(tmp_path):
    lines = [json.dumps({"text": "first doc"}), "{not json", json.dumps({"title": "no text"}),
             json.dumps({"id": "d4", "text": "fourth"}), "", json.dumps({"text": "   "})]
    path = tmp_path / "d.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"text": "bad \xff"}\n')
    ds = TextCorpusDataset(str(path))
    out = [ds[i] for i in range(len(ds))]
    assert len(ds) == 6  # blank line not indexed
    assert out[0] == {"id": "d:0", "text": "first doc"} and out[3]["id"] == "d4"
    reasons = [x.reason for x in out if isinstance(x, Skip)]
    assert reasons == ["bad_json_line", "missing_key", "empty_text", "non_utf8"]


def test_encode_text_loss_on_every_token(tok):
    chat = ChatTokenizer(tok, num_image_tokens=2)
    ids, labels = chat.encode_text("To be, or not to be <|end|> <image>", "t")
    assert ids[-1] == chat.eos_id and labels == ids and IGNORE_INDEX not in labels
    # special-token strings inside plain text are ordinary text, never specials
    assert chat.end_id not in ids[:-1] and chat.image_id not in ids
    assert chat.decode(ids) == "To be, or not to be <|end|> <image><|endoftext|>"
