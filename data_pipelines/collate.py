"""Collators: encoded samples (and Skips) -> one padded or packed batch (the batch format is in
data_pipelines/README.md); `pad_token_lists` for batches of prompts is the model package's
(vlm/modeling/padding.py).
"""

from __future__ import annotations

from collections import Counter

import torch

from vlm.modeling.chat_common import IGNORE_INDEX, Skip
from vlm.modeling.varlen import DocLayout


def truncate_sample(sample: dict, max_length: int, image_start_id, image_end_id):
    """Cut `sample` to at most max_length tokens without splitting a picture (or Skip).

    A picture is its `<im_start> <image>*P <im_end>` spans, one per view: `sample["image_views"]`
    (views per picture, from `SampleEncoder`) groups consecutive spans; without it (or when it does
    not match the spans) every span is a picture. A cut inside a picture, also between two of its
    views, moves before its first `<im_start>`: a picture is kept whole or dropped, never left with
    some of its anyres tiles. Dropped pictures lose their pixel tensors (and `image_views` entries).
    The sample is dropped as `too_long` when it had images but none survive, or when no
    loss-carrying token survives.
    """
    ids, labels = sample["input_ids"], sample["labels"]
    length = int(ids.numel())
    if length <= max_length:
        return sample
    starts = (ids == image_start_id).nonzero().flatten().tolist() if image_start_id is not None else []
    ends = (ids == image_end_id).nonzero().flatten().tolist() if image_end_id is not None else []
    pictures = _picture_spans(starts, ends, sample.get("image_views"))
    cut = max_length
    for start, end in pictures:
        if start < cut <= end:  # the cut would fall inside this picture
            cut = start
    kept_pictures = sum(1 for _, end in pictures if end < cut)
    if starts and kept_pictures == 0:
        return Skip("too_long", sample["id"], f"{length} tokens; its first image ends past {max_length}")
    if not bool((labels[1:cut] != IGNORE_INDEX).any()):
        return Skip("too_long", sample["id"], f"{length} tokens; no loss token left after cutting at {cut}")
    out = {**sample, "input_ids": ids[:cut], "labels": labels[:cut]}
    if sample["pixel_values"] is not None:
        out["pixel_values"] = sample["pixel_values"][:sum(1 for end in ends if end < cut)]  # kept views
    if sample.get("image_views") is not None:
        out["image_views"] = list(sample["image_views"])[:kept_pictures]
    return out


def _picture_spans(starts: list[int], ends: list[int], image_views) -> list[tuple[int, int]]:
    """(first <im_start>, last <im_end>) of every picture: ``image_views`` consecutive spans each."""
    if not image_views or min(image_views) < 1 or sum(image_views) != len(starts) or len(starts) != len(ends):
        return list(zip(starts, ends))
    out, first = [], 0
    for views in image_views:
        out.append((starts[first], ends[first + views - 1]))
        first += views
    return out


SKIP_EXAMPLES = 3  # Skips per reason a batch carries in `skip_examples` (the rest are only counted)


class PadCollator:
    """One sample per row, padded to the longest row of the batch.

    Padding is on the right for training; "left" is available (position ids still start at 0 at
    the first real token).
    """

    def __init__(self, pad_id: int, max_length: int, image_start_id=None, image_end_id=None,
                 padding_side: str = "right"):
        if padding_side not in ("right", "left"):
            raise ValueError("padding_side must be 'right' or 'left'")
        self.pad_id, self.max_length = int(pad_id), int(max_length)
        self.image_start_id, self.image_end_id = image_start_id, image_end_id
        self.padding_side = padding_side

    @classmethod
    def from_chat_tokenizer(cls, chat_tokenizer, max_length: int, **kwargs):
        return cls(chat_tokenizer.pad_id, max_length, chat_tokenizer.image_start_id,
                   chat_tokenizer.image_end_id, **kwargs)

    def __call__(self, items) -> dict:
        samples, skipped = self.prepare(items)
        batch = self.assemble(self.make_rows(samples), skipped)
        batch["skip_examples"] = list(getattr(self, "_last_skips", ()))
        return batch

    def make_rows(self, samples):
        return [[sample] for sample in samples]

    def prepare(self, items):
        """Drop Skips (counting them), truncate, and mask the first token of every sample."""
        samples, skipped, examples = [], Counter(), []
        self._last_skips = examples  # the first Skips of each reason, for __call__ (one call at a time)
        for item in items:
            if not isinstance(item, Skip):
                item = truncate_sample(item, self.max_length, self.image_start_id, self.image_end_id)
            if isinstance(item, Skip):
                skipped[item.reason] += 1
                if skipped[item.reason] <= SKIP_EXAMPLES:
                    examples.append(item)
                continue
            labels = item["labels"].clone()
            labels[0] = IGNORE_INDEX
            samples.append({**item, "labels": labels})
        return samples, skipped

    def assemble(self, rows, skipped) -> dict:
        width = max((sum(int(s["input_ids"].numel()) for s in row) for row in rows), default=0)
        shape = (len(rows), width)
        batch = {"input_ids": torch.full(shape, self.pad_id, dtype=torch.long),
                 "labels": torch.full(shape, IGNORE_INDEX, dtype=torch.long),
                 "attention_mask": torch.zeros(shape, dtype=torch.long),
                 "position_ids": torch.zeros(shape, dtype=torch.long),
                 "segment_ids": torch.zeros(shape, dtype=torch.long)}
        pixels = []
        for r, row in enumerate(rows):
            ids = torch.cat([s["input_ids"] for s in row])
            labels = torch.cat([s["labels"] for s in row])
            positions = torch.cat([torch.arange(s["input_ids"].numel()) for s in row])
            segments = torch.cat([torch.full((s["input_ids"].numel(),), k + 1) for k, s in enumerate(row)])
            n = ids.numel()
            cols = slice(0, n) if self.padding_side == "right" else slice(width - n, width)
            batch["input_ids"][r, cols] = ids
            batch["labels"][r, cols] = labels
            batch["attention_mask"][r, cols] = 1
            batch["position_ids"][r, cols] = positions
            batch["segment_ids"][r, cols] = segments
            pixels.extend(s["pixel_values"] for s in row if s["pixel_values"] is not None)
        batch["pixel_values"] = torch.cat(pixels) if pixels else None
        batch["skipped"] = dict(skipped)
        batch["num_samples"] = sum(len(row) for row in rows)
        return batch


class PackingCollator(PadCollator):
    """Several whole samples per row (greedy first-fit, input order within a row) up to max_length tokens."""

    def __init__(self, *args, pad_to_max_length: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.pad_to_max_length = pad_to_max_length

    def make_rows(self, samples):
        rows, lengths = [], []
        for sample in samples:
            n = int(sample["input_ids"].numel())
            for r, used in enumerate(lengths):
                if used + n <= self.max_length:
                    rows[r].append(sample)
                    lengths[r] += n
                    break
            else:
                rows.append([sample])
                lengths.append(n)
        return rows

    def assemble(self, rows, skipped) -> dict:
        batch = super().assemble(rows, skipped)
        if self.pad_to_max_length and rows and batch["input_ids"].shape[1] < self.max_length:
            extra = self.max_length - batch["input_ids"].shape[1]
            fill = {"input_ids": self.pad_id, "labels": IGNORE_INDEX, "attention_mask": 0,
                    "position_ids": 0, "segment_ids": 0}
            for key, value in fill.items():
                pad = torch.full((batch[key].shape[0], extra), value, dtype=torch.long)
                batch[key] = torch.cat([batch[key], pad] if self.padding_side == "right"
                                       else [pad, batch[key]], dim=1)
        # the token stack's document layout, here on the host where the rows are: the model moves it to
        # the device instead of reading the device to build it (vlm/modeling/varlen.py)
        batch["doc_layout"] = None
        if rows:
            batch["doc_layout"] = DocLayout.on_host(batch["attention_mask"].bool(), batch["segment_ids"])
        return batch
