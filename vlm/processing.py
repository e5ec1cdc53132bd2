"""ConceptMoEVLMProcessor: tokenizer + the vision backbone's image transform + chat format.

A plain class with the surface of a Hugging Face processor, saved as JSON files only (no pickle).
"""

from __future__ import annotations

import json
import os

import torch
from PIL import Image

from data_pipelines.chat_template import ChatTokenizer
from data_pipelines.collate import pad_token_lists
from data_pipelines.common import IMAGE_TOKEN
from data_pipelines.images import ImageTransform
from data_pipelines.tokenizer_files import save_tokenizer_folder

PROCESSOR_CONFIG = "processor_config.json"


class ConceptMoEVLMProcessor:
    """Turns prompts and PIL images into model inputs and generated ids back into text.

        processor = ConceptMoEVLMProcessor.for_model(tokenizer, model)   # or .from_pretrained(dir)
        batch = processor(text=["<image>\\nWhat digit is this?"], images=[img])   # generation prompts
        batch -> {"input_ids": Long[B,T], "attention_mask": Long[B,T], "pixel_values": Float[N,3,H,W]|None}
        processor.batch_decode(generated_ids); processor.save_pretrained(dir)

    Images go through ``image_transform``, the vision backbone's (``model.vision.image_transform()``);
    without one it is ``ImageTransform(**image_settings)`` (image_size, image_mean, image_std,
    resample, image_aspect, anyres_grids: the keys saved in ``processor_config.json``). Each picture
    gives ``image_tiles(images)`` views (1, or with image_aspect "anyres" a thumbnail + tiles, known
    from its size), each one ``pixel_values`` entry. Text: a string is one user turn (followed by
    ``<|assistant|>\\n``), a list of turns is a conversation; each ``<image>`` expands to one
    ``<im_start>`` + P x ``<image>`` + ``<im_end>`` per view of its picture (P = num_image_tokens),
    so the image-token count is known before the forward. Prompts are left-padded by default.
    Saved files: the tokenizer folder (chat template included) + ``processor_config.json``.
    """

    def __init__(self, tokenizer, num_image_tokens: int, image_transform: ImageTransform | None = None,
                 add_bos: bool | None = None, **image_settings):
        if image_transform is not None and image_settings:
            raise ValueError(f"pass image_transform or its settings, not both (got {sorted(image_settings)})")
        self.tokenizer = tokenizer
        self.image_transform = image_transform if image_transform is not None else ImageTransform(**image_settings)
        self.chat_tokenizer = ChatTokenizer(tokenizer, num_image_tokens, add_bos=add_bos)
        self.add_bos = add_bos

    @classmethod
    def for_model(cls, tokenizer, model, add_bos: bool | None = None) -> ConceptMoEVLMProcessor:
        """The processor of a built VLM: its image-token count and its vision backbone's transform."""
        return cls(tokenizer, model.num_image_tokens, model.vision.image_transform(), add_bos=add_bos)

    # ----- settings -----
    @property
    def num_image_tokens(self) -> int:
        return self.chat_tokenizer.num_image_tokens

    @property
    def image_size(self) -> int:
        return self.image_transform.image_size

    # token ids the model config needs (ConceptMoEVLMConfig.image_token_id, ...)
    image_token_id = property(lambda self: self.chat_tokenizer.image_id)
    im_start_token_id = property(lambda self: self.chat_tokenizer.image_start_id)
    im_end_token_id = property(lambda self: self.chat_tokenizer.image_end_id)
    pad_token_id = property(lambda self: self.chat_tokenizer.pad_id)
    end_token_id = property(lambda self: self.chat_tokenizer.end_id)  # generation stops here

    def to_config(self) -> dict:
        return {"processor_class": type(self).__name__, "num_image_tokens": self.num_image_tokens,
                **self.image_transform.settings(), "add_bos": self.add_bos,
                "token_ids": {name: i for name, i in self.chat_tokenizer.ids.items()}}

    # ----- images -----
    def image_tiles(self, images) -> list[int]:
        """Views per picture of a PIL image or a (nested) list of them, from the sizes alone."""
        return [self.image_transform.num_views(*image.size) for image in _flatten_images(images)]

    def preprocess_images(self, images) -> torch.Tensor | None:
        """A PIL image or a (nested) list of them -> Float[N, 3, S, S] (N = sum of ``image_tiles``:
        every view of every picture, in order), or None."""
        flat = list(_flatten_images(images))
        if not flat:
            return None
        return torch.cat([self.image_transform.views(image) for image in flat])

    # ----- text -----
    def apply_chat_template(self, conversation, add_generation_prompt: bool = True,
                            tokenize: bool = False, images=None):
        """Render a conversation (LLaVA from/value or HF role/content turns) in our chat format.

        tokenize=True returns the token ids (BOS if any, `<image>` placeholders expanded, each to
        its picture's views: with image_aspect "anyres" that needs the ``images``).
        """
        text = self.chat_tokenizer.render(conversation, add_generation_prompt=add_generation_prompt)[0]
        if not tokenize:
            return text
        if images is None and self.image_transform.image_aspect == "anyres" and IMAGE_TOKEN in text:
            raise ValueError("image_aspect 'anyres': pass images= to tokenize (views per <image> depend on its size)")
        tiles = None if images is None else self.image_tiles(images)
        return self._encode_prompts([text], tiles, chat=False)[0]

    def _encode_prompts(self, prompts, tiles: list[int] | None, chat: bool) -> list[list[int]]:
        """Token ids per prompt, the i-th `<image>` (row-major) expanded to tiles[i] views.

        tiles None: one view each, unchecked. Else the placeholders must match len(tiles) (ValueError).
        """
        rows = [self.chat_tokenizer.encode_prompt(p, chat=chat) for p in prompts]
        if tiles is None:
            return rows
        image_id, per_view = self.chat_tokenizer.image_id, self.num_image_tokens
        n_tokens = sum(row.count(image_id) for row in rows) if image_id is not None else 0
        if n_tokens != len(tiles) * per_view:
            raise ValueError(f"{n_tokens // max(per_view, 1)} <image> placeholders but {len(tiles)} images")
        if all(t == 1 for t in tiles):
            return rows  # one view each: the expansion above already is the answer
        out, first = [], 0
        for prompt, row in zip(prompts, rows):
            n = row.count(image_id) // per_view
            out.append(self.chat_tokenizer.encode_prompt(prompt, chat=chat, image_tiles=tiles[first:first + n]))
            first += n
        return out

    def __call__(self, text=None, images=None, return_tensors: str | None = "pt",
                 padding_side: str = "left", chat: bool = True) -> dict:
        """Generation prompts -> dict(input_ids, attention_mask, pixel_values).

        text: a string, a conversation (list of turn dicts), or a list of either (a batch).
        images: None, a PIL image, a list of images, or one list per prompt; they are taken
        in order of the `<image>` placeholders (row-major over the batch); pixel_values holds
        every view of every picture, and each placeholder expands to one span per view.
        """
        if text is None:
            raise ValueError("text is required (use '<image>' placeholders for images)")
        prompts = [text] if isinstance(text, str) or _is_conversation(text) else list(text)
        rows = self._encode_prompts(prompts, self.image_tiles(images), chat=chat)
        pixel_values = self.preprocess_images(images)
        if return_tensors not in ("pt", None):
            raise ValueError(f"return_tensors must be 'pt' or None, got {return_tensors!r}")
        input_ids, attention_mask = pad_token_lists(rows, self.chat_tokenizer.pad_id, padding_side)
        if return_tensors is None:
            input_ids, attention_mask = input_ids.tolist(), attention_mask.tolist()
        return {"input_ids": input_ids, "attention_mask": attention_mask, "pixel_values": pixel_values}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def batch_decode(self, sequences, skip_special_tokens: bool = True) -> list[str]:
        if isinstance(sequences, torch.Tensor):
            sequences = sequences.tolist()
        return [self.decode(seq, skip_special_tokens) for seq in sequences]

    # ----- files -----
    def save_pretrained(self, save_directory: str) -> str:
        os.makedirs(save_directory, exist_ok=True)
        save_tokenizer_folder(self.tokenizer, save_directory)
        with open(os.path.join(save_directory, PROCESSOR_CONFIG), "w", encoding="utf-8") as f:
            json.dump(self.to_config(), f, indent=2)
        return save_directory

    @classmethod
    def from_pretrained(cls, directory: str, **overrides) -> ConceptMoEVLMProcessor:
        from transformers import AutoTokenizer

        with open(os.path.join(directory, PROCESSOR_CONFIG), encoding="utf-8") as f:
            config = json.load(f)
        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
        keys = ["num_image_tokens", "add_bos"]
        if "image_transform" not in overrides:
            keys += ["image_size", "image_mean", "image_std", "resample", "image_aspect", "anyres_grids"]
        kwargs = {k: config[k] for k in keys if k in config}
        kwargs.update(overrides)
        return cls(tokenizer, **kwargs)

    def __repr__(self) -> str:
        return (f"ConceptMoEVLMProcessor(num_image_tokens={self.num_image_tokens}, "
                f"{self.image_transform!r}, vocab={len(self.tokenizer)})")


def _is_conversation(value) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict)


def _flatten_images(images):
    if images is None:
        return
    if isinstance(images, Image.Image):
        yield images
        return
    for item in images:
        yield from _flatten_images(item)
