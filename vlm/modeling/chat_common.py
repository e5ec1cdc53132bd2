"""Shared conventions of the data package: special tokens, the `Skip` marker and its reasons, record
checks (records and skips: data_pipelines/README.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# dataset types a mixture can read (the training config validates against this list)
DATASET_TYPES = ("llava_json", "text", "webdataset")

# --- special tokens (exact strings shared with the model, eval and generation code) ---
PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
IMAGE_TOKEN = "<image>"
IMAGE_START_TOKEN = "<im_start>"
IMAGE_END_TOKEN = "<im_end>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
END_TOKEN = "<|end|>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, IMAGE_TOKEN, IMAGE_START_TOKEN, IMAGE_END_TOKEN,
                  USER_TOKEN, ASSISTANT_TOKEN, END_TOKEN]

IGNORE_INDEX = -100  # label value that carries no loss

# roles accepted in conversations ("from" in LLaVA files, "role" in HF chat messages)
USER_ROLES = {"human", "user"}
ASSISTANT_ROLES = {"gpt", "assistant"}

# reasons a record can be skipped (readers, encoder, collator); others may appear
# (missing_key also covers a key of the wrong type: a turn's value that is a number, a list of
# non-parts, null, ...; bad_role covers a role that is not one of the known strings)
SKIP_REASONS = (
    "bad_json_line", "missing_key", "empty_conversation", "bad_role", "missing_image",
    "corrupt_image", "image_too_large", "placeholder_mismatch", "non_utf8", "corrupt_shard",
    "tokenization_mismatch", "too_long", "empty_text",
)

# what json.loads raises on bad input: JSONDecodeError, ValueError (an integer literal longer
# than Python's int_max_str_digits) and RecursionError (arrays / objects nested too deeply)
JSON_ERRORS = (ValueError, RecursionError)


@dataclass(frozen=True)
class Skip:
    """A record that was dropped, and why. Returned (never raised) by readers."""

    reason: str
    sample_id: str = "?"
    detail: str = ""
    where: str = field(default="", compare=False)  # "<file>#<record index>", set by the mixture

    def describe(self) -> str:
        """One line for a person: reason, record id, where it came from, detail."""
        where = f" ({self.where})" if self.where else ""
        detail = f": {self.detail}" if self.detail else ""
        return f"{self.reason}: record {self.sample_id}{where}{detail}"


def turn_role_and_text(turn: dict) -> tuple[str, str]:
    """('user'|'assistant', text) for a LLaVA turn {"from","value"} or HF message {"role","content"}.

    Raises KeyError (no role / text), TypeError (text that is not a string or a list of HF
    content parts, e.g. a number) or ValueError (unknown role), each with a one-line message.
    """
    if not isinstance(turn, dict):
        raise TypeError(f"a turn must be an object, got {type(turn).__name__}")
    role = turn.get("from", turn.get("role"))
    text = turn.get("value", turn.get("content"))
    if role is None or text is None:
        raise KeyError("turn needs 'from'/'value' (or 'role'/'content')")
    if isinstance(text, list):  # HF multimodal content: [{"type": "image"}, {"type": "text", ...}]
        pieces = []
        for part in text:
            if not isinstance(part, dict):
                raise TypeError(f"content part must be an object, got {type(part).__name__}")
            if part.get("type") == "image":
                pieces.append(IMAGE_TOKEN + "\n")
                continue
            piece = part.get("text", "")
            if not isinstance(piece, str):
                raise TypeError(f"content part 'text' must be a string, got {type(piece).__name__}")
            pieces.append(piece)
        text = "".join(pieces)
    elif not isinstance(text, str):
        raise TypeError(f"turn text must be a string, got {type(text).__name__}")
    if isinstance(role, str) and role in USER_ROLES:
        return "user", text
    if isinstance(role, str) and role in ASSISTANT_ROLES:
        return "assistant", text
    raise ValueError(f"unknown role {_short_repr(role)}")


def _short_repr(value, limit: int = 60) -> str:
    text = repr(value) if not isinstance(value, (list, dict)) else f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


def has_surrogates(value) -> bool:
    """True if any string inside `value` holds undecodable bytes (from errors='surrogateescape')
    or a lone surrogate (a JSON "\\ud800" escape). Iterative: any nesting depth is fine."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def check_conversation(conversations, num_images: int, sample_id: str) -> Skip | None:
    """Validate a conversation list; return a Skip for the first problem found, else None.

    Rules: a non-empty list of turns with known roles and string text, at least one assistant
    turn, `<image>` only in user turns, and exactly one `<image>` per attached image.
    """
    if not isinstance(conversations, list):
        return Skip("missing_key", sample_id, "'conversations' is not a list")
    if not conversations:
        return Skip("empty_conversation", sample_id, "no turns")
    placeholders, assistant_turns = 0, 0
    for turn in conversations:
        if not isinstance(turn, dict):
            return Skip("missing_key", sample_id, "turn is not an object")
        try:
            role, text = turn_role_and_text(turn)
        except KeyError as err:
            return Skip("missing_key", sample_id, str(err.args[0]))
        except TypeError as err:
            return Skip("missing_key", sample_id, str(err))
        except ValueError as err:
            return Skip("bad_role", sample_id, str(err))
        count = text.count(IMAGE_TOKEN)
        if role == "assistant":
            assistant_turns += 1
            if count:
                return Skip("placeholder_mismatch", sample_id, "<image> inside an assistant turn")
        placeholders += count
    if assistant_turns == 0:
        return Skip("empty_conversation", sample_id, "no assistant turn")
    if placeholders != num_images:
        return Skip("placeholder_mismatch", sample_id,
                    f"{placeholders} <image> placeholders for {num_images} images")
    return None
