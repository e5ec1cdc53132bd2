"""Every bad-input reason is skipped and counted (never raised mid-run); the abort limit works."""

import json

import pytest

from vlm.modeling.chat_template import ChatTokenizer, TokenizationMismatch
from vlm.modeling.image_transform import ImageTransform
from data_pipelines.mixture import TooMuchBadData, build_loader
from _data_helpers import digit_record, tiny_tokenizer, write_image

GOOD = 6


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return ChatTokenizer(tiny_tokenizer(str(tmp_path_factory.mktemp("tok"))), num_image_tokens=4)


def bad_llava(root):
    write_image(str(root / "ok.png"), "L")
    write_image(str(root / "big.png"), "L", size=(40, 40))  # 1600 px > max_image_pixels=1000
    (root / "garbage.png").write_bytes(b"\x89PNG not really")
    lines = [json.dumps(digit_record(i, "ok.png")) for i in range(GOOD)] + [
        "{not json",                                                             # bad_json_line
        json.dumps({"id": "nk", "image": "ok.png"}),                             # missing_key
        json.dumps({"id": "ec", "conversations": []}),                           # empty_conversation
        json.dumps(digit_record(10, "missing.png")),                             # missing_image
        json.dumps(digit_record(11, "garbage.png")),                             # corrupt_image
        json.dumps(digit_record(12, "big.png")),                                 # image_too_large
        json.dumps({**digit_record(13, None), "image": "ok.png"}),               # placeholder_mismatch
        json.dumps(digit_record(15, "ok.png", question="<|assistant|> hi")),     # tokenization_mismatch
        json.dumps(digit_record(16, "ok.png", question="long " * 80 + "<image>")),  # too_long
    ]
    lines[-1] = lines[-1].replace("<image>\\nlong", "long")  # keep exactly one placeholder
    data = "\n".join(lines).encode() + b'\n{"id": "u8", "image": "ok.png", "conversations": ' \
        b'[{"from": "human", "value": "<image>\\n\xff\xfe"}, {"from": "gpt", "value": "3"}]}\n'  # non_utf8
    (root / "bad.jsonl").write_bytes(data)
    return len(lines) + 1


def loader_for(root, chat, n, **cfg):
    config = {"root": str(root), "max_length": 64, "packing": False, "shuffle": False,
              "num_samples": n, "datasets": [{"name": "bad", "type": "llava_json", "path": "bad.jsonl",
                                              "max_image_pixels": 1000, "weight": 1.0}]}
    config.update(cfg)
    return build_loader(config, chat, ImageTransform(8), batch_size=4)


def test_every_reason_is_counted_once(tmp_path, chat):
    n = bad_llava(tmp_path)
    loader = loader_for(tmp_path, chat, n, max_bad_fraction=1.0)
    kept = sum(batch["num_samples"] for batch in loader)
    reasons = ["bad_json_line", "missing_key", "empty_conversation", "missing_image", "corrupt_image",
               "image_too_large", "placeholder_mismatch", "tokenization_mismatch", "too_long", "non_utf8"]
    assert dict(loader.bad_counts) == {reason: 1 for reason in reasons}
    assert kept == GOOD and loader.seen == n
    assert loader.state_dict()["bad_counts"] == dict(loader.bad_counts)


def test_batches_report_their_own_skips(tmp_path, chat):
    n = bad_llava(tmp_path)
    # two extra positions wrap around to good records, so the last batch is not empty
    per_batch = [batch["skipped"] for batch in loader_for(tmp_path, chat, n + 2, max_bad_fraction=1.0)]
    assert len(per_batch) == 3  # the two all-bad batches are not yielded ...
    assert per_batch[2] == {"placeholder_mismatch": 1, "tokenization_mismatch": 1,  # ... their skips
                            "too_long": 1, "non_utf8": 1, "missing_image": 1, "corrupt_image": 1,
                            "image_too_large": 1, "empty_conversation": 1}  # move to the next batch
    assert sum(sum(s.values()) for s in per_batch) == 10


def test_abort_when_bad_fraction_exceeded(tmp_path, chat):
    n = bad_llava(tmp_path)
    loader = loader_for(tmp_path, chat, 4 * n, min_samples_for_bad_check=20)
    with pytest.raises(TooMuchBadData, match=r"bad data on rank 0: \d+ of \d+ samples skipped .*missing_image="):
        for _ in loader:
            pass
    # below the minimum number of samples seen, no abort
    assert sum(b["num_samples"] for b in loader_for(tmp_path, chat, n, min_samples_for_bad_check=200)) == GOOD


def test_small_bad_fraction_is_tolerated(tmp_path, chat):
    write_image(str(tmp_path / "ok.png"), "L")
    lines = [json.dumps(digit_record(i, "ok.png")) for i in range(149)] + [json.dumps(digit_record(9, "x.png"))]
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    loader = loader_for(tmp_path, chat, 300)  # 2 bad of 300 = 0.67% < 1%
    assert sum(b["num_samples"] for b in loader) == 298 and loader.bad_counts == {"missing_image": 2}
    lines[:2] = [json.dumps(digit_record(i, "x.png")) for i in range(2)]  # 3 of 150 = 2%
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(TooMuchBadData):
        list(loader_for(tmp_path, chat, 300))


def test_tokenizer_without_special_tokens_is_a_mismatch(tmp_path):
    plain = ChatTokenizer(tiny_tokenizer(str(tmp_path / "t"), with_specials=False), num_image_tokens=4)
    conv = digit_record(0)["conversations"]
    with pytest.raises(TokenizationMismatch, match="lacks special tokens"):
        plain.encode_conversation(conv, "s0", num_images=1)
    write_image(str(tmp_path / "ok.png"), "L")
    (tmp_path / "bad.jsonl").write_text(json.dumps(digit_record(0, "ok.png")) + "\n")
    loader = loader_for(tmp_path, plain, 3, max_bad_fraction=1.0)
    assert list(loader) == [] and loader.bad_counts == {"tokenization_mismatch": 3}


def test_wrong_image_count_is_a_mismatch(chat):
    conv = digit_record(0)["conversations"]
    with pytest.raises(TokenizationMismatch, match="<image> in tokens, expected 2"):
        chat.encode_conversation(conv, "s", num_images=2)
