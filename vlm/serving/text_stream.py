"""Streaming text out of token ids: the decoded text so far, less any tail that may still become a stop
string or is an incomplete UTF-8 character, and where a stop string ends the answer."""
from __future__ import annotations


def stop_at(text: str, stops: tuple[str, ...]) -> int | None:
    """The index where the first stop string starts in ``text``, or None."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def safe_len(text: str, stops: tuple[str, ...]) -> int:
    """How much of ``text`` can be streamed now: not a trailing replacement character (a multi-byte
    character cut by the token boundary) nor a tail that is a prefix of a stop string."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    for s in stops:
        for k in range(min(len(s) - 1, end), 0, -1):
            if text[:end].endswith(s[:k]):
                end -= k
                break
    return end
