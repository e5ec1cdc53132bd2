"""Tokenizer folders: train our small byte-level BPE, or wrap a real pretrained SentencePiece model.

Both are standard Hugging Face folders (chat template inline) that `AutoTokenizer.from_pretrained`
loads offline, with our special tokens registered as special (never split).
"""

from __future__ import annotations

import json
import os
import shutil

from .chat_template import CHAT_TEMPLATE
from .chat_common import EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS

EXTRA_SPECIALS = [t for t in SPECIAL_TOKENS if t not in (PAD_TOKEN, EOS_TOKEN)]


def save_tokenizer_folder(tokenizer, out_dir: str) -> str:
    """save_pretrained with the chat template inline in tokenizer_config.json + special_tokens_map.json.
    A tokenizer without a chat template gets ours; one with its own (a pretrained LLM's) keeps it."""
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    special_map = dict(tokenizer.special_tokens_map)
    special_map["additional_special_tokens"] = list(tokenizer.extra_special_tokens)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump(special_map, f, indent=2)
    return out_dir


def train_bpe_tokenizer(texts, out_dir: str, vocab_size: int = 2048):
    """Train a byte-level BPE on an iterable of strings; save and return a PreTrainedTokenizerFast.

    All 256 bytes are in the alphabet (nothing is ever unknown); the special tokens get ids 0..7 in
    the order of `SPECIAL_TOKENS` (pad = 0, eos = 1).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    core.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN,
        extra_special_tokens=EXTRA_SPECIALS, clean_up_tokenization_spaces=False,
        model_max_length=1 << 20)
    save_tokenizer_folder(tokenizer, out_dir)
    return tokenizer


def sentencepiece_tokenizer_folder(model_file: str, out_dir: str):
    """Build a LlamaTokenizer folder (+ our special tokens, ids 32000.. for a 32k model) from a
    SentencePiece BPE model.

    Vocabulary and merges are read through the `sentencepiece` library itself, not transformers'
    protobuf-based converter (which breaks when the installed protobuf is older than the one
    sentencepiece's generated code wants); the result encodes exactly like SentencePiece.
    """
    import sentencepiece
    from transformers import LlamaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    scores = {piece: sp.get_score(i) for i, piece in enumerate(pieces)}
    merges = generate_merges(vocab, scores)  # SentencePiece BPE: merge priority = piece score
    special = lambda i: pieces[i] if i >= 0 else None
    tokenizer = LlamaTokenizer(vocab=vocab, merges=merges, legacy=False, add_prefix_space=True,
                               unk_token=special(sp.unk_id()), bos_token=special(sp.bos_id()),
                               eos_token=special(sp.eos_id()), clean_up_tokenization_spaces=False)
    tokenizer.add_special_tokens({"pad_token": PAD_TOKEN, "eos_token": EOS_TOKEN,
                                  "extra_special_tokens": EXTRA_SPECIALS})
    os.makedirs(out_dir, exist_ok=True)
    shutil.copyfile(model_file, os.path.join(out_dir, "tokenizer.model"))  # provenance copy
    save_tokenizer_folder(tokenizer, out_dir)
    return tokenizer
