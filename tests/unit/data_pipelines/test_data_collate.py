"""Collators: padding, greedy packing (segment/position ids), truncation around image spans; prompt padding."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from data_pipelines.collate import PackingCollator, PadCollator, truncate_sample
from vlm.modeling.padding import pad_token_lists
from vlm.modeling.chat_common import IGNORE_INDEX, Skip

PAD, IM_START, IMAGE, IM_END = 0, 3, 2, 4


def sample(name, n_text, images=(), answer=2, start=10):
    """Synthetic encoded sample: [text..., (im_start image*P im_end, text...)*, answer tokens]."""
    ids, pixels = list(range(start, start + n_text)), []
    for k, p in enumerate(images):
        ids += [IM_START] + [IMAGE] * p + [IM_END] + [start + 50 + k]
        pixels.append(torch.full((3, 2, 2), float(len(pixels) + 100 * (start % 7))))
    labels = [IGNORE_INDEX] * len(ids) + list(range(90, 90 + answer))
    ids += list(range(90, 90 + answer))
    return {"id": name, "input_ids": torch.tensor(ids), "labels": torch.tensor(labels),
            "pixel_values": torch.stack(pixels) if pixels else None}


def test_pad_collator_right_and_left():
    a, b = sample("a", 3), sample("b", 6)
    for side in ("right", "left"):
        batch = PadCollator(PAD, 64, IM_START, IM_END, padding_side=side)([a, Skip("missing_image"), b])
        assert batch["num_samples"] == 2 and batch["skipped"] == {"missing_image": 1}
        assert batch["input_ids"].shape == (2, 8) and batch["pixel_values"] is None
        row0 = batch["attention_mask"][0].bool()
        assert batch["input_ids"][0][row0].tolist() == a["input_ids"].tolist()
        assert batch["position_ids"][0][row0].tolist() == list(range(5))
        assert batch["segment_ids"][0].tolist() == ([1] * 5 + [0] * 3 if side == "right" else [0] * 3 + [1] * 5)
        assert (batch["input_ids"][0][~row0] == PAD).all() and (batch["labels"][0][~row0] == IGNORE_INDEX).all()
        assert batch["labels"][0][row0][0] == IGNORE_INDEX  # first token of a sample is never a target


def test_packing_rows_segments_positions_and_pixel_order():
    samples = [sample("a", 4, images=[2], start=10), sample("b", 8, start=20),
               sample("c", 3, images=[2, 2], start=30), sample("d", 2, start=40)]
    lengths = [len(s["input_ids"]) for s in samples]  # 11, 10, 15, 4
    batch = PackingCollator(PAD, 22, IM_START, IM_END)(samples)
    # first fit: row0 = a + b (21), c doesn't fit row0 -> row1 = c + d (19)
    assert batch["num_samples"] == 4 and batch["input_ids"].shape == (2, 21)
    row0 = torch.cat([samples[0]["input_ids"], samples[1]["input_ids"]])
    assert batch["input_ids"][0].tolist() == row0.tolist()
    assert batch["segment_ids"][0].tolist() == [1] * 11 + [2] * 10
    assert batch["position_ids"][0].tolist() == list(range(11)) + list(range(10))
    assert batch["segment_ids"][1].tolist() == [1] * 15 + [2] * 4 + [0, 0]
    assert batch["attention_mask"].sum().item() == sum(lengths)
    # the first token of every packed sample carries no loss (no cross-sample prediction)
    starts = (batch["position_ids"] == 0) & (batch["attention_mask"] == 1)
    assert (batch["labels"][starts] == IGNORE_INDEX).all()
    # pixel tensors follow the order the <image> spans appear in, row-major
    expected = torch.cat([samples[0]["pixel_values"], samples[2]["pixel_values"]])
    assert torch.equal(batch["pixel_values"], expected)
    assert int((batch["input_ids"] == IMAGE).sum()) == 2 * batch["pixel_values"].shape[0]


def test_pad_to_max_length():
    batch = PackingCollator(PAD, 32, IM_START, IM_END, pad_to_max_length=True)([sample("a", 3)])
    assert batch["input_ids"].shape == (1, 32) and batch["segment_ids"][0, 5:].eq(0).all()


def test_truncation_cuts_before_image_span_and_drops_unfit_image():
    # two turns: text, image A, answer, image B, answer  (P = 4 -> spans of 6 tokens)
    span = [IM_START] + [IMAGE] * 4 + [IM_END]
    ids = [10, 11, 12] + span + [90, 91] + span + [92, 93]  # 19 tokens, span B = positions 11..16
    labels = [IGNORE_INDEX] * 9 + [90, 91] + [IGNORE_INDEX] * 6 + [92, 93]
    s = {"id": "a", "input_ids": torch.tensor(ids), "labels": torch.tensor(labels),
         "pixel_values": torch.stack([torch.zeros(3, 2, 2), torch.ones(3, 2, 2)])}
    cut = truncate_sample(s, 14, IM_START, IM_END)  # 14 falls inside span B -> cut before it
    assert cut["input_ids"].tolist() == ids[:11] and torch.equal(cut["pixel_values"], s["pixel_values"][:1])
    # the first image cannot fit at all -> the sample is dropped
    assert truncate_sample(s, 7, IM_START, IM_END).reason == "too_long"
    # no loss token left after the cut -> dropped too
    assert truncate_sample(sample("t", 30), 20, IM_START, IM_END).reason == "too_long"
    batch = PadCollator(PAD, 7, IM_START, IM_END)([s, sample("ok", 3)])
    assert batch["skipped"] == {"too_long": 1} and batch["num_samples"] == 1


@settings(max_examples=60, deadline=None)
@given(n_text=st.integers(0, 6), images=st.lists(st.integers(1, 5), max_size=3),
       answer=st.integers(1, 6), max_length=st.integers(2, 40))
def test_truncation_never_splits_an_image_span(n_text, images, answer, max_length):
    s = sample("h", n_text, images=images, answer=answer)
    out = truncate_sample(s, max_length, IM_START, IM_END)
    if isinstance(out, Skip):
        assert out.reason == "too_long" and len(s["input_ids"]) > max_length
        return
    ids = out["input_ids"].tolist()
    assert len(ids) <= max_length and ids == s["input_ids"].tolist()[:len(ids)]
    n_spans = ids.count(IM_START)
    assert ids.count(IM_END) == n_spans  # every opened span is closed
    assert ids.count(IMAGE) == sum(images[:n_spans])
    n_pix = 0 if out["pixel_values"] is None else out["pixel_values"].shape[0]
    assert n_pix == n_spans
    if len(s["input_ids"]) > max_length:  # a truncated sample keeps at least one loss token
        assert (out["labels"][1:] != IGNORE_INDEX).any()


def test_pad_token_lists_left_and_right():
    ids, mask = pad_token_lists([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert ids.dtype == mask.dtype == torch.long
    ids, mask = pad_token_lists([[5, 6, 7], [8]], pad_id=9, side="right")
    assert ids.tolist() == [[5, 6, 7], [8, 9, 9]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert pad_token_lists([], pad_id=0)[0].shape == (0, 0)
    with pytest.raises(ValueError, match="padding_side"):
        pad_token_lists([[1]], pad_id=0, side="middle")
