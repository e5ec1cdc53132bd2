"""A pretrained model's own chat template (Hugging Face ``apply_chat_template``): rendered text, each
assistant reply's loss span, the template's end-of-turn (stop) marker and whether it writes BOS.

Loss spans come from rendering prefixes: the conversation up to assistant turn i with
``add_generation_prompt=True`` must be a prefix of the full rendered text, the reply must follow it
unchanged, and the template's stop marker must follow the reply; the span is reply + marker
(whitespace after the marker is not learned). A template that breaks any of this raises
``TemplateMismatch`` (one line), which ChatTokenizer turns into a TokenizationMismatch.
"""

from __future__ import annotations

import re

from jinja2 import TemplateError

from .chat_common import turn_role_and_text

# what rendering a template can raise: raise_exception / undefined names (TemplateError), no template
# (ValueError), and what template code hits on unexpected messages (an empty list, a bad role, ...)
TEMPLATE_ERRORS = (TemplateError, ValueError, TypeError, KeyError, IndexError, AttributeError)
PROBE_USER, PROBE_REPLY = "Probe question?", "Probe reply."


class TemplateMismatch(ValueError):
    """The chat template cannot be used for loss masks (see module docstring)."""


def hf_messages(conversations) -> list[dict]:
    """LLaVA from/value or HF role/content turns -> [{"role": "user"|"assistant", "content": str}]."""
    return [{"role": role, "content": text} for role, text in map(turn_role_and_text, conversations)]


def apply_template(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    """The tokenizer's chat template rendered as text; any template error -> TemplateMismatch."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except TEMPLATE_ERRORS as err:
        first_line = str(err).splitlines()[0] if str(err) else ""
        raise TemplateMismatch(f"chat template failed: {type(err).__name__}: {first_line}") from None
    if not isinstance(text, str):
        raise TemplateMismatch(f"chat template rendered a {type(text).__name__}, not a string")
    return text


def special_token_strings(tokenizer) -> list[str]:
    """Contents of the tokenizer's special added tokens, longest first."""
    names = {tok.content for tok in tokenizer.added_tokens_decoder.values() if tok.special}
    names.update(tokenizer.all_special_tokens)
    return sorted(names, key=len, reverse=True)


def stop_marker(tokenizer) -> str:
    """The text the template writes right after an assistant reply (e.g. ``<|im_end|>``,
    ``<|eot_id|>``), found on a probe conversation; "" when it writes nothing."""
    probe = [{"role": "user", "content": PROBE_USER}, {"role": "assistant", "content": PROBE_REPLY}]
    text = apply_template(tokenizer, probe, False)
    at = text.rfind(PROBE_REPLY)
    if at < 0:
        raise TemplateMismatch("chat template changes the reply text (probe reply not rendered)")
    chunk = re.match(r"\s*\S*", text[at + len(PROBE_REPLY):]).group(0)
    if not chunk.strip():
        return ""
    for special in special_token_strings(tokenizer):  # <|eot_id|><|end_of_text|> -> <|eot_id|>
        if chunk.startswith(special):
            return special
    return chunk


def marker_token_id(tokenizer, marker: str) -> int | None:
    """The id that ends an assistant turn: the marker when it is exactly one token, else eos."""
    ids = tokenizer(marker, add_special_tokens=False)["input_ids"] if marker else []
    return ids[0] if len(ids) == 1 else tokenizer.eos_token_id


def template_writes_bos(tokenizer) -> bool:
    """True when the chat template itself renders the BOS token (Llama-3's ``{{ bos_token }}``)."""
    bos = tokenizer.bos_token
    if not bos:
        return False
    try:
        return bos in apply_template(tokenizer, [{"role": "user", "content": PROBE_USER}], True)
    except TemplateMismatch:  # an unusable template: every sample mismatches anyway
        return False


def render_template(tokenizer, conversations, marker: str, add_generation_prompt: bool = False):
    """Rendered text plus [(start, end)] char spans of each assistant reply + ``marker``."""
    messages = hf_messages(conversations)
    text = apply_template(tokenizer, messages, add_generation_prompt)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = apply_template(tokenizer, messages[:i], True)
        if not text.startswith(prompt):
            raise TemplateMismatch(f"turn {i}: the generation prompt is not a prefix of the "
                                   "rendered conversation")
        start, reply = len(prompt), message["content"]
        end = start + len(reply)
        if text[start:end] != reply:
            raise TemplateMismatch(f"turn {i}: the chat template changes the reply text "
                                   f"(rendered {text[start:end + 20]!r})")
        if not text.startswith(marker, end):
            raise TemplateMismatch(f"turn {i}: reply not followed by the end-of-turn marker "
                                   f"{marker!r} (got {text[end:end + 20]!r})")
        spans.append((start, end + len(marker)))
    return text, spans
