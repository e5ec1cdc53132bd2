"""A pretrained LLM's own Hugging Face tokenizer, made usable by the data pipeline.

    added = prepare_llm_tokenizer(tokenizer)   # in place; [] when already prepared
    model.resize_token_embeddings(len(tokenizer)) if added else None   # the caller's job
    stop_id = chat_stop_token(tokenizer)       # generation stops at this id

Policy (data_pipelines/README.md, "Chat format and labels"): the image tokens are always added as
special tokens; the model's own pad, eos and chat template are kept; only what is missing is added
(`<|pad|>`, `<|endoftext|>`, and for a base LLM without a chat template our role tokens and
`CHAT_TEMPLATE`).
"""

from __future__ import annotations

from vlm.modeling.chat_format import marker_token_id, stop_marker
from vlm.modeling.chat_template import CHAT_TEMPLATE
from vlm.modeling.chat_common import (
    ASSISTANT_TOKEN,
    END_TOKEN,
    EOS_TOKEN,
    IMAGE_END_TOKEN,
    IMAGE_START_TOKEN,
    IMAGE_TOKEN,
    PAD_TOKEN,
    USER_TOKEN,
)

IMAGE_TOKENS = [IMAGE_TOKEN, IMAGE_START_TOKEN, IMAGE_END_TOKEN]
ROLE_TOKENS = [USER_TOKEN, ASSISTANT_TOKEN, END_TOKEN]


def prepare_llm_tokenizer(tokenizer) -> list[str]:
    """Add what the pipeline needs to a fast tokenizer, in place; return the token strings newly
    added to its vocabulary, in id order (empty when it was already prepared)."""
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("prepare_llm_tokenizer needs a fast (tokenizers-backed) tokenizer")
    before = set(tokenizer.get_vocab())
    has_template = bool(tokenizer.chat_template)
    ours = not has_template or tokenizer.chat_template == CHAT_TEMPLATE
    wanted = IMAGE_TOKENS + (ROLE_TOKENS if ours else [])
    specials = set(tokenizer.all_special_tokens)
    extra = [tok for tok in wanted if tok not in specials]
    if extra:  # appended to the tokenizer's own extra specials, never replacing them
        tokenizer.add_special_tokens({"additional_special_tokens": extra},
                                     replace_extra_special_tokens=False)
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    if tokenizer.eos_token is None:
        tokenizer.add_special_tokens({"eos_token": EOS_TOKEN})
    if not has_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    vocab = tokenizer.get_vocab()
    return sorted((tok for tok in vocab if tok not in before), key=vocab.get)


def chat_stop_token(tokenizer) -> int | None:
    """The id that ends an assistant turn (generation stops there): `<|end|>` for our template (or
    none), else the marker the model's template writes right after a reply (`<|im_end|>`,
    `<|eot_id|>`, ...) when it is exactly one token, else the tokenizer's eos id."""
    if not tokenizer.chat_template or tokenizer.chat_template == CHAT_TEMPLATE:
        return tokenizer.convert_tokens_to_ids(END_TOKEN) if END_TOKEN in tokenizer.get_vocab() else None
    return marker_token_id(tokenizer, stop_marker(tokenizer))
