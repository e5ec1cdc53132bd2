"""A chat with an exported VLM: the history in the processor's chat template, attached images, replies
streamed by transformers' ``TextIteratorStreamer`` (``model.generate`` in a thread), and the concept
boundaries the model reports over a finished reply. The terminal front end is vlm/chat.py.
"""
from __future__ import annotations

import threading

import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

from vlm.modeling.image_transform import load_image

CONCEPT_MARK = "|"  # written before each reply token that starts a concept (--show-concepts)


class BadInput(ValueError):
    """Input the chat refuses (an image path that does not exist or does not decode); one line."""


class _StopFlag(StoppingCriteria):
    """Stops ``generate`` between steps once ``event`` is set (Ctrl-C); reads a host flag, not the device."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class ChatSession:
    """History + pending images of one conversation with ``model`` (an exported VLM) and its ``processor``.

        session = ChatSession(model, processor, max_new_tokens=64)
        session.attach("digit.png")          # carried by the next user turn
        reply = session.send("What digit is this?", on_text=print)   # streamed pieces, then the whole reply
        session.reset()

    ``temperature`` 0 is greedy decoding; above 0 sampling with ``top_p``. ``stop`` (a threading.Event)
    ends a reply early when set (the chat's Ctrl-C)."""

    def __init__(self, model, processor, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0):
        self.model, self.processor = model, processor
        self.device = next(model.parameters()).device
        self.options = {"max_new_tokens": max_new_tokens, "do_sample": temperature > 0}
        if temperature > 0:
            self.options.update(temperature=temperature, top_p=top_p)
        else:  # greedy: the export's generation config may hold sampling defaults, which would warn
            self.options.update(temperature=None, top_p=None, top_k=None)
        self.stop = threading.Event()
        self.worker: threading.Thread | None = None  # the generation thread of the reply being written
        self.messages: list[dict] = []  # HF messages; user content as parts (images first, then text)
        self.images: list = []  # PIL images of the history, in placeholder order
        self.pending: list = []  # attached, not yet sent
        self.last = None  # (inputs of the last prompt, its generated ids) for concept_marks
        tokenizer = processor.tokenizer
        names = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
        self.special_tokens = sorted(names | set(tokenizer.all_special_tokens), key=len, reverse=True)

    # ----- the conversation -----
    def attach(self, path: str) -> None:
        """Queue an image for the next user turn; ``BadInput`` if it is missing or does not decode."""
        image = load_image(path)
        if not hasattr(image, "size"):  # a Skip: missing_image / corrupt_image / image_too_large
            raise BadInput(f"cannot use image {path}: {image.reason.replace('_', ' ')}"
                           + (f" ({image.detail})" if image.reason != "missing_image" else ""))
        self.pending.append(image)

    def reset(self) -> None:
        """Forget the history and any attached images."""
        self.messages, self.images, self.pending, self.last = [], [], [], None

    def check_message(self, text: str) -> None:
        """``BadInput`` if ``text`` holds a special-token string (``<image>``, ``<|end|>``, ...): typed, it
        would inject turns or an image placeholder without a picture into the chat template."""
        found = next((tok for tok in self.special_tokens if tok in text), None)
        if found is not None:
            raise BadInput(f"the message contains the special token {found!r} (attach images with /image PATH)")

    def user_message(self, text: str) -> dict:
        parts = [{"type": "image"} for _ in self.pending] + [{"type": "text", "text": text}]
        return {"role": "user", "content": parts}

    def prompt_text(self, text: str) -> str:
        """The rendered generation prompt for the history + a user turn ``text`` (with pending images)."""
        return self.processor.apply_chat_template(self.messages + [self.user_message(text)],
                                                  add_generation_prompt=True)

    def inputs(self, text: str):
        """Model inputs (input_ids, attention_mask, pixel_values) for the history + user turn ``text``."""
        images = self.images + self.pending
        batch = self.processor(text=self.prompt_text(text), images=images or None, chat=False)
        return {k: (v.to(self.device) if v is not None else None) for k, v in batch.items()}

    def interrupt(self, timeout: float = 60.0) -> None:
        """Stop the reply being generated and wait for its thread: the process may then exit (a thread
        left inside torch at exit aborts it: 'terminate called without an active exception')."""
        self.stop.set()
        if self.worker is not None:
            self.worker.join(timeout)

    def send(self, text: str, on_text=lambda piece: None) -> str:
        """Generate the reply to user turn ``text``: ``on_text`` gets each streamed piece; the turn and
        the reply join the history, and the whole reply (special tokens skipped) is returned."""
        self.check_message(text)
        self.stop.clear()
        inputs = self.inputs(text)
        streamer = TextIteratorStreamer(self.processor.tokenizer, skip_prompt=True, skip_special_tokens=True,
                                        clean_up_tokenization_spaces=False)
        result = {}

        def run():
            try:
                result["ids"] = self.model.generate(**inputs, streamer=streamer, **self.options,
                                                    stopping_criteria=StoppingCriteriaList([_StopFlag(self.stop)]))
            except Exception as err:  # noqa: BLE001  any error: re-raised in the caller's thread below
                result["error"] = err
                streamer.end()

        worker = self.worker = threading.Thread(target=run, name="chat-generate", daemon=True)
        worker.start()
        for piece in streamer:
            on_text(piece)
        worker.join()
        if "error" in result:
            raise result["error"]
        new_ids = result["ids"][0, inputs["input_ids"].shape[1]:]
        reply = self.processor.decode(new_ids, skip_special_tokens=True)
        self.messages += [self.user_message(text), {"role": "assistant", "content": reply}]
        self.images += self.pending
        self.pending = []
        self.last = (inputs, result["ids"])
        return reply

    # ----- concepts -----
    @torch.no_grad()
    def concept_marks(self, mark: str = CONCEPT_MARK) -> tuple[str, int, dict]:
        """(the last reply with ``mark`` before each token that starts a concept, the number of those
        boundaries, the model's compression stats over prompt + reply). The boundaries are the model's
        forward over the final sequence (prompt + reply), the decision the decoding steps took too;
        special tokens (the end of turn) are not shown and their boundaries not counted."""
        if self.last is None:
            raise BadInput("no reply yet: --show-concepts marks a reply")
        inputs, ids_1T = self.last
        out = self.model(input_ids=ids_1T, pixel_values=inputs["pixel_values"],
                         attention_mask=torch.ones_like(ids_1T))
        if out.boundary_mask is None:
            raise BadInput("this model has chunking switched off: it has no concepts to mark")
        start = inputs["input_ids"].shape[1]
        reply_ids = ids_1T[0, start:].tolist()
        boundary = out.boundary_mask[0, start:].tolist()
        special = set(self.processor.tokenizer.all_special_ids)
        shown = [(tok, bool(b)) for tok, b in zip(reply_ids, boundary) if tok not in special]
        marked, count, done = "", 0, ""
        for i, (_, starts) in enumerate(shown):
            # each token's text as the whole reply decodes it (a piece alone may lose its leading space)
            upto = self.processor.decode([tok for tok, _ in shown[:i + 1]], skip_special_tokens=True)
            marked += (mark if starts else "") + upto[len(done):]
            count += int(starts)
            done = upto
        return marked, count, dict(out.compression)
