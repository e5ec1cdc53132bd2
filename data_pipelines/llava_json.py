"""LLaVA-style conversation files (JSON list or JSONL) as a map-style torch Dataset.

`dataset[i]` is `{"id", "conversations", "images": [PIL RGB, ...]}` or a `Skip`; it never raises on
bad data (record format and skip reasons: data_pipelines/README.md).
"""

from __future__ import annotations

import json
import os

import numpy as np
from torch.utils.data import Dataset

from .common import JSON_ERRORS, Skip, check_conversation, has_surrogates
from .images import DEFAULT_MAX_PIXELS, load_image


class LlavaJsonDataset(Dataset):
    """Records are kept as one bytes blob + numpy offsets (JSONL: file byte offsets, read on demand),
    not as a list of dicts, so forked DataLoader workers do not copy-on-write the index. A JSON-list
    file that cannot be parsed at all raises here, at construction, not mid-run."""

    def __init__(self, path: str, image_root: str | None = None,
                 max_image_pixels: int = DEFAULT_MAX_PIXELS, name: str | None = None):
        self.path = str(path)
        self.image_root = str(image_root) if image_root is not None else os.path.dirname(self.path)
        self.max_image_pixels = int(max_image_pixels)
        self.name = name or os.path.splitext(os.path.basename(self.path))[0]
        with open(self.path, "rb") as f:
            head = f.read(4096).lstrip()
        self.is_jsonl = self.path.endswith(".jsonl") or not head.startswith(b"[")
        if self.is_jsonl:
            self._index_jsonl()
        else:
            self._index_json_list()

    # ----- indexing -----
    def _index_jsonl(self) -> None:
        starts, ends, pos = [], [], 0
        with open(self.path, "rb") as f:
            for line in f:
                if line.strip():
                    starts.append(pos)
                    ends.append(pos + len(line))
                pos += len(line)
        self._starts = np.asarray(starts, dtype=np.int64)
        self._ends = np.asarray(ends, dtype=np.int64)
        self._blob = None

    def _index_json_list(self) -> None:
        with open(self.path, "rb") as f:
            text = f.read().decode("utf-8", errors="surrogateescape")
        try:
            records = json.loads(text)
        except JSON_ERRORS as err:
            raise ValueError(f"{self.path}: not a valid JSON list ({type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''})") from None
        if not isinstance(records, list):
            raise ValueError(f"{self.path}: top-level JSON must be a list of records")
        encoded = [_encode_record(r) for r in records]
        self._ends = np.cumsum([len(e) for e in encoded], dtype=np.int64)
        self._starts = self._ends - np.asarray([len(e) for e in encoded], dtype=np.int64)
        self._blob = b"".join(encoded)

    def __len__(self) -> int:
        return len(self._starts)

    def _raw(self, index: int) -> bytes:
        start, end = int(self._starts[index]), int(self._ends[index])
        if self._blob is not None:
            return self._blob[start:end]
        with open(self.path, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    # ----- records -----
    def __getitem__(self, index: int):
        fallback_id = f"{self.name}:{index}"
        raw = self._raw(index)
        try:
            record = json.loads(raw.decode("utf-8", errors="surrogateescape"))
        except JSON_ERRORS as err:  # also too deep nesting / too long integer literals
            return Skip("bad_json_line", fallback_id, f"{type(err).__name__}: {err}")
        if not isinstance(record, dict):
            return Skip("bad_json_line", fallback_id, "record is not a JSON object")
        raw_id = record.get("id")
        sample_id = str(raw_id) if isinstance(raw_id, (str, int, float)) else fallback_id
        if has_surrogates(record):
            return Skip("non_utf8", sample_id, "record contains bytes that are not UTF-8")
        if "conversations" not in record:
            return Skip("missing_key", sample_id, "no 'conversations'")
        image_field = record.get("image")
        if image_field is None:
            paths = []
        elif isinstance(image_field, str):
            paths = [image_field]
        elif isinstance(image_field, list) and all(isinstance(p, str) for p in image_field):
            paths = image_field
        else:
            return Skip("missing_key", sample_id, "'image' must be a path or a list of paths")
        problem = check_conversation(record["conversations"], len(paths), sample_id)
        if problem is not None:
            return problem
        images = []
        for rel in paths:
            full = os.path.join(self.image_root, rel)
            image = load_image(full, self.max_image_pixels, sample_id)
            if isinstance(image, Skip):
                if full not in image.detail:  # name the image file in every image skip
                    image = Skip(image.reason, image.sample_id, f"image {full}: {image.detail}")
                elif image.detail == full:
                    image = Skip(image.reason, image.sample_id, f"image {full} not found")
                return image
            images.append(image)
        return {"id": sample_id, "conversations": record["conversations"], "images": images}


def _encode_record(record) -> bytes:
    """One record of a JSON list as ASCII JSON bytes for the blob. ensure_ascii=True keeps
    undecodable bytes as \\udcXX escapes (detected per record); a record too deeply nested to
    re-encode is stored as empty bytes, which reads back as a `bad_json_line` skip."""
    try:
        return json.dumps(record, ensure_ascii=True).encode("ascii")
    except (RecursionError, ValueError):
        return b""
