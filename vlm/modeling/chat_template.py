"""Chat format, image-placeholder expansion and loss masks, with a self-check on every sample.

Two formats: ours (`CHAT_TEMPLATE`, rendered here directly) or a pretrained model's own chat
template (rendered by the tokenizer, loss spans found by chat_format.py). The formats, the label
rule and the checks are in data_pipelines/README.md; a failed check raises
`TokenizationMismatch(sample_id, detail)`, which the loader counts as `tokenization_mismatch`.
"""

from __future__ import annotations

from .chat_format import (
    TemplateMismatch,
    apply_template,
    hf_messages,
    marker_token_id,
    render_template,
    special_token_strings,
    stop_marker,
    template_writes_bos,
)
from .chat_common import (
    ASSISTANT_TOKEN,
    END_TOKEN,
    EOS_TOKEN,
    IGNORE_INDEX,
    IMAGE_END_TOKEN,
    IMAGE_START_TOKEN,
    IMAGE_TOKEN,
    PAD_TOKEN,
    USER_TOKEN,
    turn_role_and_text,
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>\n{{ message['content'] }}<|end|>\n"
    "{% elif message['role'] == 'assistant' %}<|assistant|>\n{{ message['content'] }}<|end|>\n"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROLE_PREFIX = {"user": USER_TOKEN + "\n", "assistant": ASSISTANT_TOKEN + "\n"}
TURN_SUFFIX = END_TOKEN + "\n"


class TokenizationMismatch(Exception):
    """The tokenised sample does not match its text (see module docstring)."""

    def __init__(self, sample_id, detail: str):
        super().__init__(f"sample {sample_id}: {detail}")
        self.sample_id, self.detail = sample_id, detail


def render_ours(conversations, add_generation_prompt: bool = False):
    """Our format (`CHAT_TEMPLATE`) rendered directly: text + spans of each reply + its <|end|>."""
    text, spans = "", []
    for turn in conversations:
        role, content = turn_role_and_text(turn)
        text += ROLE_PREFIX[role]
        if role == "assistant":
            spans.append((len(text), len(text) + len(content) + len(END_TOKEN)))
        text += content + TURN_SUFFIX
    if add_generation_prompt:
        text += ROLE_PREFIX["assistant"]
    return text, spans


class ChatTokenizer:
    """Turns conversations / plain text into (input_ids, labels) lists of ints."""

    def __init__(self, tokenizer, num_image_tokens: int, add_bos: bool | None = None,
                 use_model_template: bool | None = None):
        """``use_model_template``: None = the tokenizer's chat template when it has one that is not
        ours (`CHAT_TEMPLATE`), else our format; True / False force one (True needs a template).
        ``add_bos`` None = prepend BOS when the tokenizer has one and the template does not write it."""
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError("ChatTokenizer needs a fast (tokenizers-backed) tokenizer for offsets")
        self.tokenizer = tokenizer
        self.num_image_tokens = int(num_image_tokens)
        if use_model_template is None:
            use_model_template = bool(tokenizer.chat_template) and tokenizer.chat_template != CHAT_TEMPLATE
        elif use_model_template and not tokenizer.chat_template:
            raise ValueError("use_model_template=True but the tokenizer has no chat_template")
        self.use_model_template = bool(use_model_template)
        self.marker, self.template_error = END_TOKEN, None
        if self.use_model_template:
            try:
                self.marker = stop_marker(tokenizer)
            except TemplateMismatch as err:  # unusable template: every sample mismatches with this
                self.marker, self.template_error = "", str(err)
        self._pad_key = tokenizer.pad_token or PAD_TOKEN
        self._eos_key = tokenizer.eos_token or EOS_TOKEN
        needed = [self._pad_key, self._eos_key, IMAGE_TOKEN, IMAGE_START_TOKEN, IMAGE_END_TOKEN]
        if not self.use_model_template:
            needed += [USER_TOKEN, ASSISTANT_TOKEN, END_TOKEN]
        vocab, specials = tokenizer.get_vocab(), set(tokenizer.all_special_tokens)
        # ids of the special tokens the format needs; None when one is not a special token of the
        # tokenizer (-> every sample mismatches)
        self.ids = {tok: (vocab.get(tok) if tok in specials else None) for tok in dict.fromkeys(needed)}
        self.missing = [tok for tok, i in self.ids.items() if i is None]
        self.pad_id = self.ids[self._pad_key] if self.ids[self._pad_key] is not None else 0
        self.eos_id = self.ids[self._eos_key]
        self.end_id = marker_token_id(tokenizer, self.marker) if self.use_model_template else self.ids[END_TOKEN]
        self.image_id = self.ids[IMAGE_TOKEN]
        self.image_start_id, self.image_end_id = self.ids[IMAGE_START_TOKEN], self.ids[IMAGE_END_TOKEN]
        bos_id = tokenizer.bos_token_id
        if add_bos is None:
            add_bos = bos_id is not None and not (self.use_model_template and not self.template_error
                                                  and template_writes_bos(tokenizer))
        self.add_bos = bool(add_bos)
        self.bos = [bos_id] if self.add_bos and bos_id is not None else []
        # special-token strings a turn's text must not contain (model template; ours counts ids)
        self._forbidden = [t for t in special_token_strings(tokenizer) if t != IMAGE_TOKEN]

    # ----- rendering -----
    def render(self, conversations, add_generation_prompt: bool = False):
        """Chat string plus [(start, end)] char spans of each assistant reply + its end marker.

        A model template that cannot give exact spans raises TemplateMismatch (a ValueError)."""
        if self.use_model_template:
            return render_template(self.tokenizer, conversations, self.marker, add_generation_prompt)
        return render_ours(conversations, add_generation_prompt)

    def _expand_images(self, ids: list[int], labels: list[int], image_tiles: list[int] | None = None):
        """Replace the i-th <image> id by image_tiles[i] x (<im_start> + P x <image> + <im_end>), labels
        -100. ``image_tiles`` (views per image: 1, or an anyres grid + thumbnail) defaults to 1 each."""
        if self.image_id is None or self.image_id not in ids:
            return ids, labels
        span = [self.image_start_id] + [self.image_id] * self.num_image_tokens + [self.image_end_id]
        out_ids, out_labels, index = [], [], 0
        for tok, lab in zip(ids, labels):
            if tok == self.image_id:
                views = 1 if image_tiles is None else int(image_tiles[index])
                index += 1
                out_ids.extend(span * views)
                out_labels.extend([IGNORE_INDEX] * (len(span) * views))
            else:
                out_ids.append(tok)
                out_labels.append(lab)
        return out_ids, out_labels

    # ----- encoding -----
    def encode_conversation(self, conversations, sample_id="?", num_images: int | None = None,
                            image_tiles: list[int] | None = None):
        """(input_ids, labels) for a training conversation; raises TokenizationMismatch.
        ``image_tiles``: views per image (see ``_expand_images``); None = one each."""
        if self.missing:
            raise TokenizationMismatch(sample_id, f"tokenizer lacks special tokens {self.missing}")
        if self.template_error:
            raise TokenizationMismatch(sample_id, self.template_error)
        try:
            text, spans = self.render(conversations)
        except TemplateMismatch as err:
            raise TokenizationMismatch(sample_id, str(err)) from None
        if not spans:
            raise TokenizationMismatch(sample_id, "no assistant turn to learn from")
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        labels = [IGNORE_INDEX] * len(ids)
        for i, (start, end) in enumerate(offsets):
            for span_start, span_end in spans:
                if span_start <= start and end <= span_end and end > start:
                    labels[i] = ids[i]
                elif start < span_start < end or start < span_end < end:
                    raise TokenizationMismatch(sample_id, f"token {i} straddles a reply boundary")
        if num_images is None:
            num_images = text.count(IMAGE_TOKEN)
        expected_text = [content + self.marker for role, content in map(turn_role_and_text, conversations)
                         if role == "assistant"]
        self._check(sample_id, ids, labels, expected_text, conversations, num_images)
        if image_tiles is not None and len(image_tiles) != num_images:
            raise TokenizationMismatch(sample_id, f"{len(image_tiles)} tile counts for {num_images} images")
        ids, labels = self._expand_images(ids, labels, image_tiles)
        self._check_images(sample_id, ids, num_images if image_tiles is None else sum(image_tiles))
        return self.bos + ids, [IGNORE_INDEX] * len(self.bos) + labels

    def encode_text(self, text: str, sample_id="?"):
        """(input_ids, labels) for a plain-text sample: tokens + eos, loss on every token.

        Special-token strings inside the text are tokenised as ordinary text (never as specials).
        """
        if self.eos_id is None:
            raise TokenizationMismatch(sample_id, f"tokenizer lacks {self._eos_key}")
        ids = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        ids = self.bos + ids + [self.eos_id]
        return ids, [IGNORE_INDEX] * len(self.bos) + ids[len(self.bos):]

    def encode_prompt(self, text_or_conversation, chat: bool = True, image_tiles: list[int] | None = None):
        """Input ids for generation: the user turn(s) + the generation prompt (images expanded).

        A string is one user turn; a list is a conversation (a trailing assistant turn is
        dropped, earlier ones are kept). With chat=False a string is tokenised as raw text.
        """
        if isinstance(text_or_conversation, str):
            if not chat:
                ids = self.tokenizer(text_or_conversation, add_special_tokens=False)["input_ids"]
                return self.bos + self._expand_images(ids, ids, image_tiles)[0]
            conversation = [{"from": "human", "value": text_or_conversation}]
        else:
            conversation = list(text_or_conversation)
            if conversation and turn_role_and_text(conversation[-1])[0] == "assistant":
                conversation = conversation[:-1]
        if self.use_model_template:  # no loss spans needed: history need not pass the prefix checks
            text = apply_template(self.tokenizer, hf_messages(conversation), True)
        else:
            text = render_ours(conversation, add_generation_prompt=True)[0]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.bos + self._expand_images(ids, ids, image_tiles)[0]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    # ----- self-checks -----
    def _check(self, sample_id, ids, labels, expected_text, conversations, num_images):
        if self.use_model_template:
            return self._check_model_template(sample_id, ids, labels, expected_text, conversations,
                                              num_images)
        self._check_labels(sample_id, ids, labels, expected_text)
        roles = [turn_role_and_text(t)[0] for t in conversations]
        expected_counts = {self.ids[USER_TOKEN]: roles.count("user"),
                           self.ids[ASSISTANT_TOKEN]: roles.count("assistant"),
                           self.end_id: len(roles), self.image_id: num_images,
                           self.image_start_id: 0, self.image_end_id: 0,
                           self.pad_id: 0, self.eos_id: 0}
        self._check_counts(sample_id, ids, expected_counts)

    def _check_model_template(self, sample_id, ids, labels, expected_text, conversations, num_images):
        for _, content in map(turn_role_and_text, conversations):
            found = next((tok for tok in self._forbidden if tok in content), None)
            if found is not None:
                raise TokenizationMismatch(sample_id, f"turn text contains the special token {found!r}")
        self._check_labels(sample_id, ids, labels, expected_text)
        expected_counts = {self.image_id: num_images, self.image_start_id: 0, self.image_end_id: 0}
        if self.pad_id not in (self.eos_id, self.end_id, self.tokenizer.bos_token_id):
            expected_counts[self.pad_id] = 0  # a pad that is also eos / stop / bos may be written
        self._check_counts(sample_id, ids, expected_counts)

    def _check_labels(self, sample_id, ids, labels, expected_text):
        runs, current = [], []
        for tok, lab in zip(ids, labels):
            if lab != IGNORE_INDEX:
                current.append(tok)
            elif current:
                runs.append(current)
                current = []
        if current:
            runs.append(current)
        decoded = [self.decode(run) for run in runs]
        if decoded != expected_text:
            raise TokenizationMismatch(
                sample_id, f"labelled tokens decode to {decoded!r}, expected {expected_text!r}")

    def _check_counts(self, sample_id, ids, expected_counts):
        for tok_id, want in expected_counts.items():
            got = ids.count(tok_id)
            if got != want:
                name = self.tokenizer.convert_ids_to_tokens(tok_id)
                raise TokenizationMismatch(sample_id, f"{got} x {name} in tokens, expected {want}")

    def _check_images(self, sample_id, ids, num_views):
        got = ids.count(self.image_id) if self.image_id is not None else 0
        if got != self.num_image_tokens * num_views:
            raise TokenizationMismatch(sample_id, f"{got} <image> tokens for {num_views} image views "
                                                  f"x {self.num_image_tokens}")
