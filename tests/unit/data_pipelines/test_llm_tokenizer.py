"""A pretrained LLM's own tokenizer and chat template: prepare_llm_tokenizer, the stop token, and
ChatTokenizer's generic-template path (labels, BOS, prompts, images, self-checks), on three tiny
offline tokenizers shaped like Qwen2 (ChatML), Llama-3 and a base LLM without a chat template."""

import json
import os

import pytest
from _data_helpers import TINY_CORPUS, session_default_data
from transformers import AutoTokenizer

from vlm.modeling.chat_template import (
    CHAT_TEMPLATE,
    ChatTokenizer,
    TokenizationMismatch,
)
from vlm.modeling.chat_common import IGNORE_INDEX
from data_pipelines.llm_tokenizer import chat_stop_token, prepare_llm_tokenizer

P = 3  # image tokens per image in these tests
IMAGE_TOKENS = ["<image>", "<im_start>", "<im_end>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

# flavour -> (own special tokens, tokenizer kwargs, template, stop marker, generation prompt)
FLAVOURS = {
    "chatml": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
               {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                "extra_special_tokens": ["<|im_start|>", "<|im_end|>"]},
               CHATML_TEMPLATE, "<|im_end|>", "<|im_start|>assistant\n"),
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eot_id|>"],
               {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                "extra_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]},
               LLAMA3_TEMPLATE, "<|eot_id|>", "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "base": (["<s>", "</s>"], {"bos_token": "<s>", "eos_token": "</s>"}, None, "<|end|>",
             "<|assistant|>\n"),
}
EXPECTED_ADDED = {"chatml": IMAGE_TOKENS, "llama3": IMAGE_TOKENS + ["<|pad|>"],
                  "base": IMAGE_TOKENS + ["<|user|>", "<|assistant|>", "<|end|>", "<|pad|>"]}

CONVERSATION = [
    {"from": "human", "value": "<image>\nWhat digit is this?"}, {"from": "gpt", "value": "3"},
    {"from": "human", "value": "Is it even or odd?"}, {"from": "gpt", "value": "odd"},
    {"from": "human", "value": "<image>\nAnd this one?"}, {"from": "gpt", "value": "A small gray square."}]


def llm_tokenizer_folder(out_dir: str, flavour: str) -> str:
    """A byte-level BPE shaped like the flavour's LLM tokenizer, saved as an HF folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials, kwargs, template = FLAVOURS[flavour][:3]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(TINY_CORPUS * 5, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, clean_up_tokenization_spaces=False, **kwargs)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module", params=list(FLAVOURS))
def flavour(request):
    return request.param


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, flavour):
    """(flavour, prepared tokenizer reloaded from its saved folder)."""
    root = tmp_path_factory.mktemp(f"tok_{flavour}")
    tokenizer = AutoTokenizer.from_pretrained(llm_tokenizer_folder(str(root / "raw"), flavour))
    prepare_llm_tokenizer(tokenizer)
    tokenizer.save_pretrained(str(root / "prepared"))
    return flavour, AutoTokenizer.from_pretrained(str(root / "prepared"))


@pytest.fixture(scope="module")
def chat(prepared):
    return prepared[0], ChatTokenizer(prepared[1], num_image_tokens=P)


def labelled_runs(chat_tokenizer, ids, labels):
    runs, current = [], []
    for tok, lab in zip(ids + [None], labels + [IGNORE_INDEX]):
        if lab != IGNORE_INDEX:
            assert lab == tok
            current.append(tok)
        elif current:
            runs.append(chat_tokenizer.decode(current))
            current = []
    return runs


def test_prepare_adds_what_is_missing_and_is_idempotent(tmp_path, flavour):
    tokenizer = AutoTokenizer.from_pretrained(llm_tokenizer_folder(str(tmp_path / "raw"), flavour))
    own_specials, own_pad, own_eos = list(tokenizer.all_special_tokens), tokenizer.pad_token, tokenizer.eos_token
    added = prepare_llm_tokenizer(tokenizer)
    assert added == EXPECTED_ADDED[flavour]
    assert prepare_llm_tokenizer(tokenizer) == []
    assert tokenizer.pad_token == (own_pad or "<|pad|>") and tokenizer.eos_token == own_eos
    template = FLAVOURS[flavour][2]
    assert tokenizer.chat_template == (template or CHAT_TEMPLATE)
    tokenizer.save_pretrained(str(tmp_path / "prepared"))
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path / "prepared"))
    assert prepare_llm_tokenizer(reloaded) == []
    assert reloaded.chat_template == tokenizer.chat_template and len(reloaded) == len(tokenizer)
    specials = set(reloaded.all_special_tokens)
    assert set(added) <= specials and set(own_specials) <= specials  # own extras kept
    vocab = reloaded.get_vocab()
    for tok in added:  # never split, even glued to text
        assert reloaded("ab" + tok + "cd", add_special_tokens=False)["input_ids"].count(vocab[tok]) == 1


def test_our_template_without_role_tokens_gets_them(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(llm_tokenizer_folder(str(tmp_path / "raw"), "base"))
    assert chat_stop_token(tokenizer) is None  # no template, no <|end|> yet
    tokenizer.chat_template = CHAT_TEMPLATE
    assert prepare_llm_tokenizer(tokenizer) == EXPECTED_ADDED["base"]
    assert chat_stop_token(tokenizer) == tokenizer.convert_tokens_to_ids("<|end|>")
    assert ChatTokenizer(tokenizer, num_image_tokens=P).missing == []


def test_missing_lists_only_what_the_format_needs(tmp_path, flavour):
    tokenizer = AutoTokenizer.from_pretrained(llm_tokenizer_folder(str(tmp_path / "raw"), flavour))
    missing = ChatTokenizer(tokenizer, num_image_tokens=P).missing
    own_format_needs = ["<|user|>", "<|assistant|>", "<|end|>"] if flavour == "base" else []
    pad = [] if tokenizer.pad_token else ["<|pad|>"]
    assert sorted(missing) == sorted(pad + IMAGE_TOKENS + own_format_needs)
    with pytest.raises(TokenizationMismatch, match="lacks special tokens"):
        ChatTokenizer(tokenizer, num_image_tokens=P).encode_conversation(CONVERSATION, "s", num_images=2)


def test_stop_token_is_the_templates_marker(chat):
    flavour, ct = chat
    marker = FLAVOURS[flavour][3]
    assert ct.missing == [] and ct.marker == marker
    assert ct.end_id == chat_stop_token(ct.tokenizer) == ct.tokenizer.convert_tokens_to_ids(marker)
    assert ct.eos_id == ct.tokenizer.eos_token_id and ct.use_model_template == (flavour != "base")


def test_labelled_runs_are_replies_plus_marker(chat):
    flavour, ct = chat
    ids, labels = ct.encode_conversation(CONVERSATION, "s", num_images=2)
    marker = FLAVOURS[flavour][3]
    assert labelled_runs(ct, ids, labels) == ["3" + marker, "odd" + marker, "A small gray square." + marker]
    assert ids.count(ct.image_id) == 2 * P and ids.count(ct.image_start_id) == 2
    assert all(lab == IGNORE_INDEX for tok, lab in zip(ids, labels)
               if tok in (ct.image_id, ct.image_start_id, ct.image_end_id))
    if flavour == "chatml":  # the default system prompt is rendered and carries no loss
        assert ct.decode(ids).startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")


def test_bos_is_never_duplicated(chat):
    flavour, ct = chat
    ids, labels = ct.encode_conversation(CONVERSATION, "s", num_images=2)
    prompt = ct.encode_prompt("<image>\nWhat digit is this?")
    bos_id = ct.tokenizer.bos_token_id
    if flavour == "chatml":
        assert bos_id is None and ct.bos == []
    else:  # llama3: written by its template; base: prepended by us (add_bos follows the template)
        assert ct.add_bos == (flavour == "base")
        for row in (ids, prompt):
            assert row[0] == bos_id and row.count(bos_id) == 1
        assert labels[0] == IGNORE_INDEX


def test_prompt_ends_with_generation_prompt_and_prefixes_training(chat):
    flavour, ct = chat
    conv = CONVERSATION[:2]
    ids, labels = ct.encode_conversation(conv, "s", num_images=1)
    prompt = ct.encode_prompt(conv)  # trailing assistant turn dropped
    assert ct.decode(prompt).endswith(FLAVOURS[flavour][4])
    assert prompt == ids[:len(prompt)] and ct.encode_prompt(conv[0]["value"]) == prompt
    assert labels[len(prompt)] != IGNORE_INDEX and set(labels[:len(prompt)]) == {IGNORE_INDEX}
    history = ct.encode_prompt(CONVERSATION[:3])  # earlier turns kept, images expanded
    assert history.count(ct.image_id) == P and ct.decode(history).endswith(FLAVOURS[flavour][4])


def test_image_tiles_expand_each_image(chat):
    _, ct = chat
    ids, labels = ct.encode_conversation(CONVERSATION, "s", num_images=2, image_tiles=[5, 1])
    plain_ids, _ = ct.encode_conversation(CONVERSATION, "s", num_images=2)
    assert ids.count(ct.image_id) == 6 * P and ids.count(ct.image_start_id) == 6
    assert len(ids) == len(plain_ids) + 4 * (P + 2) and labelled_runs(ct, ids, labels)
    first = ids.index(ct.image_start_id)
    view = [ct.image_start_id] + [ct.image_id] * P + [ct.image_end_id]
    assert ids[first:first + 5 * len(view)] == view * 5
    with pytest.raises(TokenizationMismatch, match="tile counts"):
        ct.encode_conversation(CONVERSATION, "s", num_images=2, image_tiles=[1])
    prompt = ct.encode_prompt("<image>\nWhat digit is this?", image_tiles=[3])
    assert prompt.count(ct.image_start_id) == 3


def test_generic_self_checks(chat):
    flavour, ct = chat
    for bad_text in ("<im_start> sneaky", f"a {ct.tokenizer.pad_token} b", FLAVOURS[flavour][3] + " fake"):
        conv = [{"from": "human", "value": bad_text}, {"from": "gpt", "value": "3"}]
        with pytest.raises(TokenizationMismatch):
            ct.encode_conversation(conv, "s", num_images=0)
    with pytest.raises(TokenizationMismatch, match="image"):  # placeholders vs declared images
        ct.encode_conversation(CONVERSATION, "s", num_images=1)


@pytest.fixture(scope="module")
def default_root(tmp_path_factory):
    return session_default_data(tmp_path_factory)


@pytest.mark.parametrize("force", ["flag", "template_copy"])
def test_generic_path_matches_fast_path_on_default_data(default_root, force):
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(default_root, "tokenizer"))
    fast = ChatTokenizer(tokenizer, num_image_tokens=P)
    assert not fast.use_model_template
    if force == "flag":
        generic = ChatTokenizer(tokenizer, num_image_tokens=P, use_model_template=True)
    else:
        copy = AutoTokenizer.from_pretrained(os.path.join(default_root, "tokenizer"))
        copy.chat_template = CHAT_TEMPLATE + "{# a copy, not the same string #}"
        generic = ChatTokenizer(copy, num_image_tokens=P)
    assert generic.use_model_template and generic.missing == []
    assert (generic.end_id, generic.eos_id, generic.pad_id, generic.image_id, generic.bos) == \
        (fast.end_id, fast.eos_id, fast.pad_id, fast.image_id, fast.bos)
    with open(os.path.join(default_root, "digits_train.json"), encoding="utf-8") as f:
        records = json.load(f)[:200]
    records.append({"id": "multi", "conversations": CONVERSATION})
    for record in records:
        conv = record["conversations"]
        n = sum(turn["value"].count("<image>") for turn in conv)
        assert generic.encode_conversation(conv, record["id"], n) == fast.encode_conversation(conv, record["id"], n)
        assert generic.encode_prompt(conv) == fast.encode_prompt(conv)
        assert generic.render(conv) == fast.render(conv)


BROKEN_TEMPLATES = {
    "changes the reply": CHATML_TEMPLATE.replace("message['content'] + '<|im_end|>'",
                                                 "message['content'] | upper + '<|im_end|>'"),
    "prefix": CHATML_TEMPLATE.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant:\\n'"),
    "marker": CHATML_TEMPLATE.replace(
        "+ '<|im_end|>' + '\\n'",
        "+ ('<|im_end|>' if message['role'] == 'user' or loop.last else '') + '\\n'"),
    "failed": CHATML_TEMPLATE.replace("{% endfor %}", "{% if loop.index0 == 2 %}"
                                      "{{ raise_exception('two turns only') }}{% endif %}{% endfor %}"),
}


@pytest.mark.parametrize("kind", list(BROKEN_TEMPLATES))
def test_broken_template_is_a_mismatch_not_wrong_labels(tmp_path, kind):
    tokenizer = AutoTokenizer.from_pretrained(llm_tokenizer_folder(str(tmp_path / "raw"), "chatml"))
    prepare_llm_tokenizer(tokenizer)
    tokenizer.chat_template = BROKEN_TEMPLATES[kind]
    ct = ChatTokenizer(tokenizer, num_image_tokens=P)
    with pytest.raises(TokenizationMismatch, match=kind) as err:
        ct.encode_conversation(CONVERSATION, "s7", num_images=2)
    assert err.value.sample_id == "s7" and "\n" not in str(err.value)


def test_llama3_trim_of_reply_whitespace_is_a_mismatch(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(llm_tokenizer_folder(str(tmp_path / "raw"), "llama3"))
    prepare_llm_tokenizer(tokenizer)
    ct = ChatTokenizer(tokenizer, num_image_tokens=P)  # its template trims message content
    assert ct.encode_conversation([{"from": "human", "value": "hi"}, {"from": "gpt", "value": "3"}], "s", 0)
    conv = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": " 3 "}]
    with pytest.raises(TokenizationMismatch, match="turn 1: the chat template changes the reply text"):
        ct.encode_conversation(conv, "s", num_images=0)
