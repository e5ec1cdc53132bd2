"""Tiny stand-ins for a pretrained LLM and a pretrained ViT, written by the libraries themselves (random
weights), for the CPU version of the "start from pretrained models" flow (docs/pretrained.md) and its test.

    python scripts/tiny_pretrained.py --out runs/tiny_parts [--llm olmoe|qwen2|llama] [--vision siglip|clip]

Writes ``<out>/llm`` (``save_pretrained`` of a transformers causal LM + its own fast tokenizer: a BPE
trained on the default data's text, ``<|endoftext|>`` eos, ``<|padding|>`` pad, a ChatML chat template)
and ``<out>/vit`` (a transformers SigLIP / CLIP vision model + its image processor, 16 x 16 px images,
4 x 4 patches). The LLM's vocabulary is padded to a multiple of 16 rows, as real checkpoints do.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers as T

ROOT = Path(__file__).resolve().parents[1]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|padding|>", "<|im_start|>", "<|im_end|>"]
LLM = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
           max_position_embeddings=512, rms_norm_eps=1e-5)
LLM_FAMILIES = {
    "olmoe": (T.OlmoeConfig, T.OlmoeForCausalLM, dict(num_experts=8, num_experts_per_tok=2)),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
}
VIT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, patch_size=4,
           image_size=16)


def corpus(data_root: Path) -> list[str]:
    """Text to train the tokenizer on: the default data's questions and answers, some Shakespeare."""
    lines = []
    for name in ("digits_train.json", "digits_val.json"):
        path = data_root / name
        if path.is_file():
            for record in json.loads(path.read_text()):
                lines += [turn["value"].replace("<image>", "") for turn in record["conversations"]]
    text = data_root / "shakespeare_train.txt"
    if text.is_file():
        lines += text.read_text(encoding="utf-8").splitlines()[:4000]
    lines += [f"{i} {i + 1} even odd" for i in range(100)]
    return lines


def save_tokenizer(folder: Path, data_root: Path, vocab: int = 500):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(data_root), trainer)
    fast = T.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|padding|>")
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    return fast


def save_llm(folder: Path, family: str, vocab_size: int, eos: int, pad: int, seed: int = 0):
    cfg_cls, model_cls, extra = LLM_FAMILIES[family]
    torch.manual_seed(seed)
    config = cfg_cls(**{**LLM, **extra}, vocab_size=vocab_size, eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    model = model_cls(config).float().eval()
    model.save_pretrained(folder)
    return model


def save_vit(folder: Path, kind: str, seed: int = 0):
    torch.manual_seed(seed + 1)
    if kind == "siglip":
        model = T.SiglipVisionModel(T.SiglipVisionConfig(**VIT))
        processor = T.SiglipImageProcessor(size={"height": 16, "width": 16}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    else:
        model = T.CLIPVisionModel(T.CLIPVisionConfig(**VIT))
        processor = T.CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for llm/ and vit/")
    ap.add_argument("--llm", choices=sorted(LLM_FAMILIES), default="olmoe")
    ap.add_argument("--vision", choices=("siglip", "clip"), default="siglip")
    ap.add_argument("--data", default=str(ROOT / "data" / "default"), help="text for the tokenizer (make data)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    tokenizer = save_tokenizer(out / "llm", Path(args.data))
    vocab = -(-len(tokenizer) // 16) * 16
    save_llm(out / "llm", args.llm, vocab, tokenizer.eos_token_id, tokenizer.pad_token_id)
    save_vit(out / "vit", args.vision)
    print(f"tiny stand-ins -> {out}: llm/ ({args.llm}, vocab {vocab}, tokenizer {len(tokenizer)} tokens, "
          f"ChatML template), vit/ ({args.vision}, 16 px, 16 patches); random weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
