"""Plain-text corpora as a map-style torch Dataset yielding `{"id", "text"}` records or Skips
(`.txt` cut into chunks at line boundaries; `.jsonl` one `{"text": ...}` document per line).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
from torch.utils.data import Dataset

from vlm.modeling.chat_common import JSON_ERRORS, Skip, has_surrogates


def _utf8_boundary(data: bytes, pos: int) -> int:
    """Largest position <= pos that does not cut a UTF-8 multi-byte character."""
    while 0 < pos < len(data) and (data[pos] & 0xC0) == 0x80:
        pos -= 1
    return pos


class TextCorpusDataset(Dataset):
    """`.txt`: chunks of at most `max_tokens` tokens, whole lines added while they fit (a longer line
    is split at a UTF-8 character boundary). Line lengths are estimated from bytes: bytes per token is
    measured on ~2,000 evenly spaced lines with `tokenizer` (else `chars_per_token`), plus a 10% margin,
    so indexing takes milliseconds; `exact_counts=True` tokenises every line. A chunk can still
    overflow by a few tokens; the collator truncates. `.jsonl` documents are not chunked.

    A chunk / line that is not valid UTF-8 is a `non_utf8` Skip; NUL bytes are removed silently.
    """

    def __init__(self, path: str, tokenizer=None, max_tokens: int = 512,
                 chars_per_token: float = 4.0, exact_counts: bool = False, name: str | None = None):
        self.path = str(path)
        self.exact_counts = exact_counts
        self.name = name or os.path.splitext(os.path.basename(self.path))[0]
        self.max_tokens = int(max_tokens)
        self.is_jsonl = self.path.endswith(".jsonl")
        with open(self.path, "rb") as f:
            data = f.read()
        lines = data.split(b"\n")
        line_starts = np.cumsum([0] + [len(line) + 1 for line in lines[:-1]], dtype=np.int64)
        if self.is_jsonl:
            keep = [i for i, line in enumerate(lines) if line.strip()]
            self._starts = line_starts[keep]
            self._ends = self._starts + np.asarray([len(lines[i]) for i in keep], dtype=np.int64)
            self._data = None  # JSONL is read from disk on demand
        else:
            self._data = data
            self._starts, self._ends = self._chunk(lines, line_starts, tokenizer, chars_per_token)

    def _chunk(self, lines, line_starts, tokenizer, chars_per_token):
        if tokenizer is not None and not self.exact_counts:
            chars_per_token = self._estimate_chars_per_token(lines, tokenizer)
        if tokenizer is not None and self.exact_counts:
            texts = [line.decode("utf-8", errors="replace") + "\n" for line in lines]
            lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False,
                                                     split_special_tokens=True)["input_ids"]]
        else:  # estimate with a 10% safety margin so few chunks overflow max_tokens
            lengths = [math.ceil((len(line) + 1) / chars_per_token * 1.1) for line in lines]
        starts, ends = [], []
        chunk_start, chunk_tokens = None, 0
        for line, start, n in zip(lines, line_starts, lengths):
            start, end = int(start), int(start) + len(line) + 1
            if chunk_start is not None and chunk_tokens + n > self.max_tokens:
                starts.append(chunk_start)
                ends.append(start)
                chunk_start, chunk_tokens = None, 0
            if n > self.max_tokens:  # one very long line: split it by bytes
                step = max(1, int(len(line) * self.max_tokens / n))
                pos = start
                while pos < end:
                    cut = min(end, _utf8_boundary(self._data, pos + step))
                    cut = cut if cut > pos else min(end, pos + step)
                    starts.append(pos)
                    ends.append(cut)
                    pos = cut
                continue
            if chunk_start is None:
                chunk_start = start
            chunk_tokens += n
        if chunk_start is not None:
            starts.append(chunk_start)
            ends.append(len(self._data))
        starts = np.asarray(starts, dtype=np.int64)
        ends = np.minimum(np.asarray(ends, dtype=np.int64), len(self._data))
        keep = ends > starts  # e.g. the empty piece after the file's final newline
        return starts[keep], ends[keep]

    @staticmethod
    def _estimate_chars_per_token(lines, tokenizer, sample_lines: int = 2000) -> float:
        step = max(1, len(lines) // sample_lines)
        sample = b"\n".join(lines[::step]).decode("utf-8", errors="replace")
        n_tokens = len(tokenizer(sample, add_special_tokens=False, split_special_tokens=True)["input_ids"])
        return max(1.0, len(sample.encode("utf-8")) / max(1, n_tokens))

    def __len__(self) -> int:
        return len(self._starts)

    def _raw(self, index: int) -> bytes:
        start, end = int(self._starts[index]), int(self._ends[index])
        if self._data is not None:
            return self._data[start:end]
        with open(self.path, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    def __getitem__(self, index: int):
        sample_id = f"{self.name}:{index}"
        try:
            text = self._raw(index).decode("utf-8")
        except UnicodeDecodeError as err:
            return Skip("non_utf8", sample_id, str(err))
        if self.is_jsonl:
            try:
                record = json.loads(text)
            except JSON_ERRORS as err:  # also too deep nesting / too long integer literals
                return Skip("bad_json_line", sample_id, f"{type(err).__name__}: {err}")
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                return Skip("missing_key", sample_id, "no string 'text'")
            if isinstance(record.get("id"), (str, int, float)):
                sample_id = str(record["id"])
            text = record["text"]
            if has_surrogates(text):  # a JSON "\\ud800" escape: not encodable text
                return Skip("non_utf8", sample_id, "text holds a lone surrogate")
        text = text.replace("\x00", "")
        if not text.strip():
            return Skip("empty_text", sample_id, "only whitespace")
        return {"id": sample_id, "text": text}
