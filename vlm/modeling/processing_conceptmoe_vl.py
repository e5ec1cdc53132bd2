"""ConceptMoEVLMProcessor: a transformers processor (tokenizer + ConceptMoEImageProcessor + chat format).

``AutoProcessor.from_pretrained(export)`` returns it once this module is imported (it registers
itself for ``ConceptMoEVLMConfig``), and so ``pipeline("image-text-to-text", model=export)`` can use
it. Saved files (JSON only, no pickle): the tokenizer folder (``save_tokenizer_folder``: chat
template inline in tokenizer_config.json) + ``processor_config.json`` as transformers writes it
(``image_processor`` nested; the image settings also flat at the top, the layout earlier exports
used, which ``from_pretrained`` still reads).
"""

from __future__ import annotations

import json
import os

import torch
from transformers import AutoProcessor, BatchFeature, PreTrainedTokenizerBase
from transformers.dynamic_module_utils import custom_object_save
from transformers.processing_utils import ProcessorMixin
from transformers.utils import PROCESSOR_NAME

from .chat_template import CHAT_TEMPLATE, ChatTokenizer
from .padding import pad_token_lists
from .chat_common import ASSISTANT_ROLES, IMAGE_TOKEN, USER_ROLES
from .tokenizer_files import save_tokenizer_folder
from .configuration_conceptmoe_vl import ConceptMoEVLMConfig
from .image_processing_conceptmoe_vl import ConceptMoEImageProcessor

PROCESSOR_CONFIG = PROCESSOR_NAME  # "processor_config.json"
IMAGE_SETTINGS = ("image_size", "image_mean", "image_std", "resample", "image_aspect", "anyres_grids")
# Our chat format (`CHAT_TEMPLATE`, unchanged for user / assistant turns) plus system messages: the
# format has no system role, so system text opens the next user turn (as Mistral's template does).
# Not added to `CHAT_TEMPLATE` itself: ChatTokenizer knows our format by that exact string, so a new
# string would put tokenizers saved with it (data/default, existing exports) on the path for
# a pretrained LLM's template. Training data with system turns is still refused (turn_role_and_text).
PROCESSOR_CHAT_TEMPLATE = (
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = ns.system + message['content'] + '\\n\\n' %}"
    "{% elif message['role'] == 'user' %}<|user|>\n{{ ns.system + message['content'] }}<|end|>\n"
    "{% set ns.system = '' %}"
    "{% elif message['role'] == 'assistant' %}"
    "{% if ns.system %}{{ raise_exception('a system message must be followed by a user message') }}{% endif %}"
    "<|assistant|>\n{{ message['content'] }}<|end|>\n"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if ns.system %}{{ raise_exception('a system message must be followed by a user message') }}{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ConceptMoEVLMProcessor(ProcessorMixin):
    """Turns prompts and PIL images into model inputs and generated ids back into text.

        processor = ConceptMoEVLMProcessor.for_model(tokenizer, model)   # or .from_pretrained(dir)
        batch = processor(text=["<image>\\nWhat digit is this?"], images=[img])   # generation prompts
        batch -> {"input_ids": Long[B,T], "attention_mask": Long[B,T], "pixel_values": Float[N,3,H,W]|None}
        processor.apply_chat_template(messages, tokenize=True, return_dict=True)   # HF messages
        processor.batch_decode(generated_ids); processor.save_pretrained(dir)

    Images: ``image_processor`` (a ``ConceptMoEImageProcessor``; or give ``image_transform``, the
    vision backbone's ``ImageTransform``, or its settings as keywords). Each picture gives
    ``image_tiles(images)`` views (1, or with image_aspect "anyres" a thumbnail + tiles), each one
    ``pixel_values`` entry. Text: a string is one user turn (chat=False: raw text), a list of turns
    (LLaVA from/value or HF role/content, "system" included) is a conversation, rendered with
    ``chat_template`` + the generation prompt (a trailing assistant turn is dropped); each
    ``<image>`` expands to one ``<im_start>`` + P x ``<image>`` + ``<im_end>`` per view of its
    picture (P = num_image_tokens). Prompts are left-padded by default.

    ``chat_template`` (the processor's; the tokenizer keeps its own): ``PROCESSOR_CHAT_TEMPLATE``
    when the tokenizer uses our format, else the tokenizer's template (a pretrained LLM's). It is
    derived again on loading, not saved.
    """

    def __init__(self, tokenizer=None, image_processor=None, num_image_tokens: int | None = None,
                 chat_template: str | None = None, add_bos: bool | None = None, image_transform=None,
                 **image_settings):
        given = [name for name, value in (("image_processor", image_processor is not None),
                                          ("image_transform", image_transform is not None),
                                          ("image settings", bool(image_settings))) if value]
        if len(given) > 1:
            raise ValueError(f"pass one of image_processor, image_transform or its settings, not both (got {given}"
                             f"{' ' + str(sorted(image_settings)) if image_settings else ''})")
        if num_image_tokens is None:
            raise TypeError("ConceptMoEVLMProcessor needs num_image_tokens")
        if image_processor is None:
            image_processor = (ConceptMoEImageProcessor.from_transform(image_transform) if image_transform is not None
                               else ConceptMoEImageProcessor(**image_settings))
        chat = ChatTokenizer(tokenizer, num_image_tokens, add_bos=add_bos)
        if chat_template is None or chat_template == CHAT_TEMPLATE:
            chat_template = tokenizer.chat_template if chat.use_model_template else PROCESSOR_CHAT_TEMPLATE
        super().__init__(tokenizer, image_processor, chat_template=chat_template)
        self.chat_tokenizer, self.add_bos = chat, add_bos

    def check_argument_for_proper_class(self, argument_name, argument):
        """transformers' type check without its optional imports (its tokenizer check imports
        MistralCommonBackend, which fails where mistral_common lacks its extras)."""
        proper = {"tokenizer": PreTrainedTokenizerBase, "image_processor": ConceptMoEImageProcessor}[argument_name]
        if not isinstance(argument, proper):
            raise TypeError(f"{argument_name} must be a {proper.__name__}, got {type(argument).__name__}")
        return proper

    @classmethod
    def for_model(cls, tokenizer, model, add_bos: bool | None = None) -> ConceptMoEVLMProcessor:
        """The processor of a built VLM: its image-token count and its vision backbone's transform."""
        return cls(tokenizer, num_image_tokens=model.num_image_tokens,
                   image_transform=model.vision.image_transform(), add_bos=add_bos)

    # ----- settings -----
    num_image_tokens = property(lambda self: self.chat_tokenizer.num_image_tokens)
    image_transform = property(lambda self: self.image_processor.transform)
    image_size = property(lambda self: self.image_processor.image_size)
    # token ids the model config needs (ConceptMoEVLMConfig.image_token_id, ...)
    image_token_id = property(lambda self: self.chat_tokenizer.image_id)
    im_start_token_id = property(lambda self: self.chat_tokenizer.image_start_id)
    im_end_token_id = property(lambda self: self.chat_tokenizer.image_end_id)
    pad_token_id = property(lambda self: self.chat_tokenizer.pad_id)
    end_token_id = property(lambda self: self.chat_tokenizer.end_id)  # generation stops here

    def to_dict(self) -> dict:
        return {"processor_class": type(self).__name__, "image_processor": self.image_processor.to_dict(),
                "num_image_tokens": self.num_image_tokens, "add_bos": self.add_bos,
                "token_ids": dict(self.chat_tokenizer.ids),
                **self.image_transform.settings()}  # also at top level: the flat layout that loaders read too

    # ----- images -----
    def image_tiles(self, images) -> list[int]:
        """Views per picture of a PIL image or a (nested) list of them, from the sizes alone."""
        return self.image_processor.image_tiles(images)

    def preprocess_images(self, images) -> torch.Tensor | None:
        """A PIL image or a (nested) list of them -> Float[N, 3, S, S] (N = sum of ``image_tiles``), or None."""
        return self.image_processor(images)["pixel_values"]

    # ----- text -----
    def apply_chat_template(self, conversation, chat_template: str | None = None,
                            add_generation_prompt: bool | None = None, tokenize: bool = False,
                            return_dict: bool = False, return_tensors="auto", images=None,
                            processor_kwargs: dict | None = None, **kwargs):
        """Render (and with tokenize=True encode) HF messages or LLaVA turns; transformers' own
        ``ProcessorMixin.apply_chat_template`` on the messages with their content made text.

        Content parts ``{"type": "image"}`` become ``<image>\\n`` (the training convention), ``text``
        parts their text; pictures come from the parts (``image`` / ``url`` / ``path``) or ``images=``.
        add_generation_prompt None = unless the last turn is the assistant's. tokenize=True:
        return_dict=True gives input_ids, attention_mask, pixel_values (``<image>`` expanded per view);
        else the ids (a flat list for one conversation with return_tensors "auto" / None). Without
        pictures each ``<image>`` counts one view (image_aspect "anyres" needs them: ValueError).
        """
        batched = isinstance(conversation, (list, tuple)) and bool(conversation) and (
            isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages"))
        conversations = [getattr(c, "messages", c) for c in conversation] if batched else [conversation]
        messages, found = zip(*(text_messages(c) for c in conversations))
        continuing = bool(kwargs.get("continue_final_message"))
        if add_generation_prompt is None:
            add_generation_prompt = not continuing and all(m and m[-1]["role"] != "assistant" for m in messages)
        if kwargs.get("return_assistant_tokens_mask"):
            raise ValueError("return_assistant_tokens_mask is not supported by ConceptMoEVLMProcessor")
        render = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt, **kwargs)
        messages = list(messages) if batched else messages[0]
        if images is None and any(found):
            images = list(found) if batched else found[0]
        elif images is not None and not isinstance(images, (list, tuple)):
            images = [images]
        flat_ids = not return_dict and return_tensors in ("auto", None)  # a tokenizer's answer: lists
        tensors = None if flat_ids else "pt" if return_tensors == "auto" else return_tensors
        if not tokenize or images is None:
            text = super().apply_chat_template(messages, tokenize=False, **render)
            if not tokenize:
                return text
            texts = text if batched else [text]
            if self.image_processor.image_aspect == "anyres" and any(IMAGE_TOKEN in t for t in texts):
                raise ValueError("image_aspect 'anyres': pass images= to tokenize (views per <image> depend on its size)")
            out = self._batch(self._encode_prompts(texts, None), None, tensors,
                              (processor_kwargs or {}).get("padding_side", "left"))
        else:
            call_kwargs = {**(processor_kwargs or {}), "images": images, "chat": False, "return_tensors": tensors}
            out = super().apply_chat_template(messages, tokenize=True, return_dict=True,
                                              processor_kwargs=call_kwargs, **render)
        if return_dict:
            return out
        if not flat_ids:
            return out["input_ids"]
        rows = [[i for i, keep in zip(row, mask) if keep] for row, mask in zip(out["input_ids"], out["attention_mask"])]
        return rows if batched else rows[0]

    def _encode_prompts(self, texts, tiles: list[int] | None) -> list[list[int]]:
        """Token ids of rendered prompts (BOS if any), the i-th `<image>` (row-major) expanded to tiles[i]
        views. tiles None: one view each, unchecked; else the placeholders must match len(tiles)."""
        chat = self.chat_tokenizer
        rows = [chat.encode_prompt(t, chat=False) for t in texts]
        if tiles is None:
            return rows
        per_view = self.num_image_tokens
        n_tokens = sum(row.count(chat.image_id) for row in rows) if chat.image_id is not None else 0
        if n_tokens != len(tiles) * per_view:
            raise ValueError(f"{n_tokens // max(per_view, 1)} <image> placeholders but {len(tiles)} images")
        if all(t == 1 for t in tiles):
            return rows  # one view each: the expansion above already is the answer
        out, first = [], 0
        for text, row in zip(texts, rows):
            n = row.count(chat.image_id) // per_view
            out.append(chat.encode_prompt(text, chat=False, image_tiles=tiles[first:first + n]))
            first += n
        return out

    def _render_prompt(self, prompt, chat: bool) -> str:
        """A string (one user turn; chat=False: itself) or a conversation -> the generation prompt text."""
        if isinstance(prompt, str):
            if not chat:
                return prompt
            prompt = [{"role": "user", "content": prompt}]
        messages = text_messages(prompt)[0]
        if messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        return super().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def __call__(self, text=None, images=None, return_tensors: str | None = "pt", padding_side: str = "left",
                 chat: bool = True, videos=None, audio=None, padding=True, add_special_tokens=None, **kwargs):
        """Generation prompts -> BatchFeature(input_ids, attention_mask, pixel_values).

        text: a string, a conversation (list of turn dicts), or a list of either (a batch); with
        chat=False strings are already-rendered prompts. images: None, a PIL image, a list of
        images, or one list per prompt, taken in order of the `<image>` placeholders (row-major over
        the batch); pixel_values holds every view of every picture, and each placeholder expands to
        one span per view. Rows are always padded (``padding``) and BOS follows ``add_bos``
        (``add_special_tokens`` is accepted for transformers' callers and not used).
        """
        if kwargs:
            raise TypeError(f"ConceptMoEVLMProcessor got unexpected arguments {sorted(kwargs)}")
        if videos is not None or audio is not None:
            raise ValueError("ConceptMoEVLMProcessor takes text and images only")
        if text is None:
            raise ValueError("text is required (use '<image>' placeholders for images)")
        prompts = [text] if isinstance(text, str) or _is_conversation(text) else list(text)
        pictures = self.image_processor.load(images)  # paths / URLs loaded once
        rows = self._encode_prompts([self._render_prompt(p, chat) for p in prompts], self.image_tiles(pictures))
        return self._batch(rows, self.preprocess_images(pictures), return_tensors, padding_side)

    def _batch(self, rows, pixel_values, return_tensors, padding_side: str = "left") -> BatchFeature:
        if return_tensors not in ("pt", None):
            raise ValueError(f"return_tensors must be 'pt' or None, got {return_tensors!r}")
        input_ids, attention_mask = pad_token_lists(rows, self.chat_tokenizer.pad_id, padding_side)
        if return_tensors is None:
            input_ids, attention_mask = input_ids.tolist(), attention_mask.tolist()
        return BatchFeature({"input_ids": input_ids, "attention_mask": attention_mask, "pixel_values": pixel_values})

    def decode(self, ids, skip_special_tokens: bool = True, **kwargs) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)

    def batch_decode(self, sequences, skip_special_tokens: bool = True, **kwargs) -> list[str]:
        if isinstance(sequences, torch.Tensor):
            sequences = sequences.tolist()
        if sequences and isinstance(sequences[0], int):
            sequences = [sequences]
        return [self.decode(seq, skip_special_tokens, **kwargs) for seq in sequences]

    def post_process_image_text_to_text(self, generated_outputs, skip_special_tokens=True, **kwargs):
        """Generated ids (the pipeline's call) -> one string per sequence."""
        return self.batch_decode(generated_outputs, skip_special_tokens=skip_special_tokens, **kwargs)

    # ----- files -----
    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs) -> str:
        """The tokenizer folder + processor_config.json (transformers' ``to_json_file``); returns the folder."""
        if push_to_hub:
            raise ValueError("ConceptMoEVLMProcessor.save_pretrained writes a folder; push it with huggingface_hub")
        os.makedirs(save_directory, exist_ok=True)
        save_tokenizer_folder(self.tokenizer, str(save_directory))
        remote = {}  # this package's code files, and their auto_map (transformers' remote-code saving)
        custom_object_save(self, save_directory, config=remote)
        with open(os.path.join(save_directory, PROCESSOR_CONFIG), "w", encoding="utf-8") as f:
            f.write(json.dumps({**self.to_dict(), **remote}, indent=2, sort_keys=True) + "\n")
        return str(save_directory)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs) -> ConceptMoEVLMProcessor:
        """transformers' loading; the tokenizer never runs remote code unless trust_remote_code=True.
        ``image_transform=`` (an ImageTransform) replaces the saved image settings."""
        kwargs.setdefault("trust_remote_code", False)
        if kwargs.get("image_transform") is not None:
            kwargs["image_processor"] = ConceptMoEImageProcessor.from_transform(kwargs.pop("image_transform"))
        saved = os.path.join(pretrained_model_name_or_path, kwargs.get("subfolder", ""), PROCESSOR_CONFIG)
        if kwargs.get("image_processor") is None and os.path.isfile(saved):
            # our image settings, nested or flat (both layouts exist), so that transformers' own lookup
            # (which needs the nested layout in some versions) is never asked for them
            with open(saved, encoding="utf-8") as f:
                processor_dict = json.load(f)
            settings = processor_dict.get("image_processor") or {k: processor_dict[k] for k in IMAGE_SETTINGS
                                                                 if k in processor_dict}
            settings = {k: v for k, v in settings.items() if k in IMAGE_SETTINGS}
            kwargs["image_processor"] = ConceptMoEImageProcessor(**settings)
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    @classmethod
    def _get_arguments_from_pretrained(cls, pretrained_model_name_or_path, processor_dict=None, **kwargs):
        """[tokenizer, image processor]: the image settings nested or flat (both layouts exist)."""
        processor_dict = processor_dict or {}
        if "num_image_tokens" not in processor_dict:
            raise FileNotFoundError(f"no {PROCESSOR_CONFIG} with num_image_tokens in {pretrained_model_name_or_path} "
                                    "(export the processor with the model)")
        own = {"image_processor", "image_transform", "num_image_tokens", "add_bos", "chat_template", *IMAGE_SETTINGS}
        kwargs = {k: v for k, v in kwargs.items() if k not in own}
        subfolder = kwargs.pop("subfolder", "")
        tokenizer = cls._load_tokenizer_from_pretrained("tokenizer", pretrained_model_name_or_path,
                                                        subfolder=subfolder, **kwargs)
        settings = processor_dict.get("image_processor") or {k: processor_dict[k] for k in IMAGE_SETTINGS
                                                             if k in processor_dict}
        return [tokenizer, ConceptMoEImageProcessor(**settings)]

    def __repr__(self) -> str:
        return (f"ConceptMoEVLMProcessor(num_image_tokens={self.num_image_tokens}, "
                f"{self.image_transform!r}, vocab={len(self.tokenizer)})")


def text_messages(conversation) -> tuple[list[dict], list]:
    """LLaVA from/value or HF role/content turns -> ([{"role", "content": str}], pictures in order).

    Roles: human / user -> user, gpt / assistant -> assistant, system kept. Content parts: image
    (also OpenAI's image_url) -> ``<image>\\n`` and its picture if the part holds one, text -> its text.
    """
    messages, images = [], []
    for turn in conversation:
        if not isinstance(turn, dict):
            raise TypeError(f"a turn must be an object, got {type(turn).__name__}")
        role, content = turn.get("role", turn.get("from")), turn.get("content", turn.get("value"))
        if role is None or content is None:
            raise KeyError("turn needs 'role'/'content' (or 'from'/'value')")
        role = "user" if role in USER_ROLES else "assistant" if role in ASSISTANT_ROLES else role
        if isinstance(content, list):
            pieces = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("image", "image_url"):
                    pieces.append(IMAGE_TOKEN + "\n")
                    picture = next((part[k] for k in ("image", "url", "path", "base64") if part.get(k) is not None), None)
                    if kind == "image_url":
                        picture = part["image_url"].get("url") if isinstance(part["image_url"], dict) else part["image_url"]
                    if picture is not None:
                        images.append(picture)
                elif kind == "text" and isinstance(part.get("text"), str):
                    pieces.append(part["text"])
                else:
                    raise ValueError(f"content parts must be image or text parts, got {str(part)[:60]}")
            content = "".join(pieces)
        elif not isinstance(content, str):
            raise TypeError(f"turn content must be a string or a list of parts, got {type(content).__name__}")
        messages.append({"role": role, "content": content})
    return messages, images


def _is_conversation(value) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict)


AutoProcessor.register(ConceptMoEVLMConfig, ConceptMoEVLMProcessor, exist_ok=True)
ConceptMoEVLMProcessor.register_for_auto_class("AutoProcessor")
