"""A SentencePiece BPE model trained here (byte fallback, as Llama's and Mistral's have), and tiny
Mistral / Mixtral checkpoint folders that ship it the way the Hugging Face releases do
(``tokenizer.model`` + ``tokenizer.json`` + ``tokenizer_config.json`` with ``LlamaTokenizer``)."""
from __future__ import annotations

import io
from pathlib import Path

import torch

SP_CORPUS = [f"{w} {n} {m}" for n in range(60) for w, m in (
    ("What digit is this? It is", "even or odd"), ("The quick brown fox jumps over", "lazy dogs"),
    ("To be, or not to be, that is the question:", "whether 'tis nobler"), ("Hello world", "new line"))]
# Mistral-7B-Instruct's template (v0.1), the model's own chat format: a reply ends with eos
MISTRAL_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
                    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}"
                    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}")
LLM = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)


def train_sentencepiece(path: Path, vocab_size: int = 400) -> Path:
    """Train a BPE SentencePiece model on ``SP_CORPUS`` (deterministic, < 1 s); ids: unk 0, bos 1, eos 2;
    the normalizer of Llama's and Mistral's models."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(SP_CORPUS), model_writer=buf, vocab_size=vocab_size,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0, unk_id=0,
                                   bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2,
                                   # Llama's / Mistral's normalizer settings: text kept as it is
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   split_digits=True, allow_whitespace_only_pieces=True)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(buf.getvalue())
    return Path(path)


def llama_tokenizer(model_file: Path):
    """The ``LlamaTokenizer`` of a SentencePiece model alone (no tokens of ours), as a release has it."""
    import sentencepiece as spm
    from transformers import LlamaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    merges = generate_merges(vocab, {piece: sp.get_score(i) for i, piece in enumerate(pieces)})
    tok = LlamaTokenizer(vocab=vocab, merges=merges, legacy=False, add_prefix_space=True, unk_token="<unk>",
                         bos_token="<s>", eos_token="</s>", clean_up_tokenization_spaces=False)
    tok.chat_template = MISTRAL_TEMPLATE
    return tok


def mistral_family_folder(out: Path, family: str, seed: int = 0) -> Path:
    """A random ``MistralForCausalLM`` / ``MixtralForCausalLM`` (safetensors) + its SentencePiece tokenizer."""
    import transformers as T

    out = Path(out)
    model_file = train_sentencepiece(out / "tokenizer.model")
    tok = llama_tokenizer(model_file)
    tok.save_pretrained(out)
    cfg_cls, model_cls, extra = {
        "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(sliding_window=None)),
        "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2)),
    }[family]
    torch.manual_seed(seed)
    config = cfg_cls(**LLM, **extra, vocab_size=len(tok), bos_token_id=1, eos_token_id=2, pad_token_id=None)
    model_cls(config).float().eval().save_pretrained(out)
    return out
