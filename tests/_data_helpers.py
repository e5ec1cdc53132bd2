"""Test builders for data inputs: a tiny BPE tokenizer, images in any PIL mode, LLaVA JSON files, the
default dataset (once per session). Fast and offline; everything goes into a caller-given folder."""

from __future__ import annotations

import json
import os

import numpy as np
from PIL import Image

TINY_CORPUS = [
    "What digit is this?", "Is it even or odd?", "What is this digit plus one?",
    "even", "odd", "Describe the image.", "A small gray square.",
    "To be, or not to be, that is the question:",
    "Whether 'tis nobler in the mind to suffer", "The slings and arrows of outrageous fortune,",
] + [str(d) for d in range(20)]


def tiny_tokenizer(out_dir: str, with_specials: bool = True, vocab_size: int = 400):
    """A byte-level BPE trained on a few lines (with or without our special tokens)."""
    from vlm.modeling.tokenizer_files import train_bpe_tokenizer

    if with_specials:
        return train_bpe_tokenizer(TINY_CORPUS * 5, out_dir, vocab_size)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(TINY_CORPUS * 5, trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=core)


def write_image(path: str, mode: str = "L", size=(8, 8), value: int = 128) -> str:
    """Write an image in the given PIL mode (L, LA, RGB, RGBA, CMYK, I;16, P) filled with `value`."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    w, h = size
    if mode == "I;16":
        image = Image.fromarray(np.full((h, w), value * 257, dtype=np.uint16))
    elif mode == "P":
        image = Image.new("L", size, value).convert("P")
    else:
        channels = {"L": 1, "LA": 2, "RGB": 3, "RGBA": 4, "CMYK": 4}[mode]
        fill = tuple([value] * channels) if channels > 1 else value
        if mode in ("LA", "RGBA"):
            fill = fill[:-1] + (255,)
        if mode == "CMYK":
            fill = (0, 0, 0, 255 - value)
        image = Image.new(mode, size, fill)
    image.save(path)
    return path


def digit_record(i: int, image: str | list | None = "img.png", question="What digit is this?",
                 answer="3") -> dict:
    record = {"id": f"r{i}", "conversations": [
        {"from": "human", "value": ("<image>\n" if image else "") + question},
        {"from": "gpt", "value": answer}]}
    if image is not None:
        record["image"] = image
    return record


def write_llava(path: str, records, jsonl: bool = False) -> str:
    with open(path, "w", encoding="utf-8") as f:
        if jsonl:
            f.writelines((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
        else:
            json.dump(records, f)
    return path


def session_default_data(tmp_path_factory) -> str:
    """The default dataset, built once per pytest session under the session's base temp dir."""
    from data_pipelines.default_data import build

    out = str(tmp_path_factory.getbasetemp() / "default_data")
    build(out, quiet=True)  # idempotent: later calls find .built and return at once
    return out
