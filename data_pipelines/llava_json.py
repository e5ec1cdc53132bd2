"""LLaVA-style conversation files (JSON list or JSONL) as a map-style torch Dataset.

`dataset[i]` is `{"id", "conversations", "images": [PIL RGB, ...]}` or a `Skip`; it never raises on
bad data (record format and skip reasons: data_pipelines/README.md).
"""

from __future__ import annotations

import json
import os

from torch.utils.data import Dataset

from . import jsonl_index
from vlm.modeling.chat_common import JSON_ERRORS, Skip, check_conversation, has_surrogates
from vlm.modeling.image_transform import DEFAULT_MAX_PIXELS, load_image


class LlavaJsonDataset(Dataset):
    """Records are located through a byte-span index (`jsonl_index.py`): built once per file version,
    saved next to the data or under `index_cache_dir`, memory-mapped (forked DataLoader workers
    share its pages), and read on demand from the file. A JSON-list file that cannot be parsed
    raises here, at construction, not mid-run. `collective_index=True` (the training loader, built
    by every rank): rank 0 builds the index while the other ranks wait at a barrier."""

    def __init__(self, path: str, image_root: str | None = None,
                 max_image_pixels: int = DEFAULT_MAX_PIXELS, name: str | None = None,
                 index_cache_dir: str | None = None, collective_index: bool = False):
        self.path = str(path)
        self.image_root = str(image_root) if image_root is not None else os.path.dirname(self.path)
        self.max_image_pixels = int(max_image_pixels)
        self.name = name or os.path.splitext(os.path.basename(self.path))[0]
        with open(self.path, "rb") as f:
            head = f.read(4096).lstrip()
        self.is_jsonl = self.path.endswith(".jsonl") or not head.startswith(b"[")
        kind = jsonl_index.KIND_JSONL if self.is_jsonl else jsonl_index.KIND_JSON_LIST
        spans, self.index_path, self.index_built = jsonl_index.load_or_build(self.path, kind, index_cache_dir,
                                                                             collective_index)
        self._starts, self._ends = spans[:, 0], spans[:, 1]

    def __len__(self) -> int:
        return len(self._starts)

    def _raw(self, index: int) -> bytes:
        start, end = int(self._starts[index]), int(self._ends[index])
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

