"""The embedded default dataset: builds offline, exact counts, held-out splits, tokenizer, labels."""

import json
import os

import pytest
from transformers import AutoTokenizer

from data_pipelines import default_data
from vlm.modeling.chat_template import ChatTokenizer
from vlm.modeling.chat_common import IGNORE_INDEX, SPECIAL_TOKENS
from data_pipelines.llava_json import LlavaJsonDataset
from _data_helpers import session_default_data


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return session_default_data(tmp_path_factory)


@pytest.fixture(scope="module")
def tokenizer(root):
    return AutoTokenizer.from_pretrained(os.path.join(root, "tokenizer"))


def load(root, split):
    with open(os.path.join(root, f"digits_{split}.json")) as f:
        return json.load(f)


def test_counts_and_files(root):
    with open(os.path.join(root, "manifest.json")) as f:
        manifest = json.load(f)
    assert {s: manifest[f"digits_{s}"]["images"] for s in ("train", "val", "test")} == \
        {"train": 1437, "val": 180, "test": 180}
    assert [len(load(root, s)) for s in ("train", "val", "test")] == [4311, 540, 540]
    assert len(os.listdir(os.path.join(root, "images", "digits"))) == 1797
    assert manifest["shakespeare_train"]["plays"] == 35 and manifest["shakespeare_val"]["plays"] == 3
    assert manifest["tokenizer"]["vocab_size"] == 2048
    for name in ("README.md", ".built", "shakespeare_train.txt", "shakespeare_val.txt",
                 "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
                 "tokenizer/special_tokens_map.json"):
        assert os.path.isfile(os.path.join(root, name)), name
    with open(os.path.join(root, "README.md")) as f:
        readme = f.read()
    assert "CC BY 4.0" in readme and "MIT" in readme and "public domain" in readme


def test_splits_do_not_share_images_and_answers_are_right(root):
    images = {s: {r["image"] for r in load(root, s)} for s in ("train", "val", "test")}
    assert not images["train"] & images["val"] and not images["train"] & images["test"]
    assert not images["val"] & images["test"]
    from sklearn.datasets import load_digits
    target = load_digits().target
    for record in load(root, "val"):
        digit = int(target[int(record["image"].split("/")[1].split(".")[0])])
        question, answer = (t["value"] for t in record["conversations"])
        expected = {"What digit is this?": str(digit), "Is it even or odd?": "even" if digit % 2 == 0 else "odd",
                    "What is this digit plus one?": str(digit + 1)}[question.split("\n", 1)[1]]
        assert question.startswith("<image>\n") and answer == expected
    image = LlavaJsonDataset(os.path.join(root, "digits_test.json"), os.path.join(root, "images"))[0]["images"][0]
    assert image.size == (8, 8) and image.mode == "RGB"


def test_held_out_plays(root):
    with open(os.path.join(root, "shakespeare_train.txt"), encoding="utf-8") as f:
        train = f.read()
    with open(os.path.join(root, "shakespeare_val.txt"), encoding="utf-8") as f:
        val = f.read()
    titles = lambda text: {line for line in text.split("\n") if line in ("Macbeth", "The Tempest",
                                                                       "Twelfth Night", "Hamlet")}
    assert titles(val) == {"Macbeth", "The Tempest", "Twelfth Night"} and titles(train) == {"Hamlet"}
    assert "**" not in train and "\\-" not in train and "HAMLET:\n" in train


def test_tokenizer_special_tokens_are_single_ids(tokenizer):
    ids = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS)
    assert ids == list(range(8)) and tokenizer.pad_token_id == 0 and tokenizer.eos_token_id == 1
    for token, token_id in zip(SPECIAL_TOKENS, ids):
        assert tokenizer(f"a{token}b", add_special_tokens=False)["input_ids"][1] == token_id
        assert tokenizer(token, add_special_tokens=False)["input_ids"] == [token_id]
    assert tokenizer.bos_token is None and len(tokenizer) == 2048


def test_all_digit_labels_redecode_exactly(root, tokenizer):
    chat = ChatTokenizer(tokenizer, num_image_tokens=16)
    for split in ("train", "val", "test"):
        for record in load(root, split)[::7]:
            ids, labels = chat.encode_conversation(record["conversations"], record["id"], num_images=1)
            labelled = [t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX]
            assert chat.decode(labelled) == record["conversations"][1]["value"] + "<|end|>"
            assert ids.count(chat.image_id) == 16


def test_second_build_is_a_noop(root, capsys):
    stamp = os.path.getmtime(os.path.join(root, ".built"))
    assert default_data.main(["--out", root]) == 0
    assert "already built" in capsys.readouterr().out
    assert os.path.getmtime(os.path.join(root, ".built")) == stamp


def test_crash_leaves_nothing_marked_built(tmp_path, monkeypatch):
    def boom(staging):  # crash after writing part of the dataset
        with open(os.path.join(staging, "digits_train.json"), "w") as f:
            f.write("[]")
        raise RuntimeError("simulated crash")
    monkeypatch.setattr(default_data, "build_digits", boom)
    out = tmp_path / "d"
    with pytest.raises(RuntimeError):
        default_data.build(str(out), quiet=True)
    assert not out.exists() and os.listdir(tmp_path) == []  # staging removed, nothing in place
    (out).mkdir()
    (out / "something.txt").write_text("not ours")
    with pytest.raises(FileExistsError):
        default_data.build(str(out), quiet=True)
