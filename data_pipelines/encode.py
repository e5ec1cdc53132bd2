"""Raw record -> encoded sample, run inside DataLoader workers:

    {"id": str, "input_ids": Long[L], "labels": Long[L], "pixel_values": Float[n,3,H,W] | None,
     "image_views": list[int] | None}

Each picture becomes ``image_transform.views(image)`` (1 view, or an anyres thumbnail + tiles), one
``<im_start> <image>*P <im_end>`` span per view; ``pixel_values`` is the concatenation of all views
and ``image_views`` the views per picture (``truncate_sample`` keeps a picture whole with it).
"""

from __future__ import annotations

import torch

from vlm.modeling.chat_template import ChatTokenizer, TokenizationMismatch
from vlm.modeling.chat_common import Skip


class SampleEncoder:
    """Encodes one record; a Skip passes through, and an error while encoding becomes a Skip
    (`tokenization_mismatch`, or `unexpected_error:<ExceptionType>`), so one odd record cannot end a
    long run (the loader's bad-data limit still stops a run where it happens systematically)."""

    def __init__(self, chat_tokenizer: ChatTokenizer, image_transform=None):
        self.chat_tokenizer = chat_tokenizer
        self.image_transform = image_transform

    def __call__(self, record):
        if isinstance(record, Skip):
            return record
        sample_id = str(record.get("id", "?"))
        try:
            return self._encode(record, sample_id)
        except TokenizationMismatch as err:
            return Skip("tokenization_mismatch", sample_id, err.detail)
        except Exception as err:  # noqa: BLE001 - counted, never silently ignored
            return Skip(f"unexpected_error:{type(err).__name__}", sample_id, str(err))

    def _encode(self, record, sample_id):
        pixel_values, image_views = None, None
        if "conversations" in record:
            images = record.get("images") or []
            if images and self.image_transform is not None:  # from the sizes: text is checked before pixels
                image_views = [self.image_transform.num_views(*im.size) for im in images]
            ids, labels = self.chat_tokenizer.encode_conversation(
                record["conversations"], sample_id, num_images=len(images), image_tiles=image_views)
            if images:
                if self.image_transform is None:
                    raise ValueError("record has images but no image_transform was given")
                views = [self.image_transform.views(im) for im in images]
                if [v.shape[0] for v in views] != image_views:
                    raise ValueError(f"views per image {[v.shape[0] for v in views]} != predicted {image_views}")
                pixel_values = torch.cat(views)
        else:
            ids, labels = self.chat_tokenizer.encode_text(record["text"], sample_id)
        return {"id": sample_id, "input_ids": torch.tensor(ids, dtype=torch.long),
                "labels": torch.tensor(labels, dtype=torch.long), "pixel_values": pixel_values,
                "image_views": image_views}
