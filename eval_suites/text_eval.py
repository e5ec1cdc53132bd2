"""Perplexity, bits per byte and the achieved compression ratio of a checkpoint's language model on
text (``evaluate_text`` states the method).

    python -m eval_suites.text_eval --checkpoint runs/train-vlm/hf --text data/default/shakespeare_val.txt
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from eval_suites.common import checkpoint_problem

MODEL_TYPES = ("conceptmoe_vlm", "conceptmoe")


def load_language_model(checkpoint: str, dtype: str = "float32", device: str = "cpu"):
    """(language model in eval mode, its text config) from an HF export folder."""
    import torch

    from vlm import register_auto_classes
    from vlm.modeling.modeling_conceptmoe import ConceptMoEForCausalLM
    from vlm.modeling.modeling_conceptmoe_vl import ConceptMoEVLMForConditionalGeneration

    register_auto_classes()
    with open(os.path.join(checkpoint, "config.json"), encoding="utf-8") as f:
        model_type = json.load(f).get("model_type")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    if model_type == "conceptmoe_vlm":
        lm = ConceptMoEVLMForConditionalGeneration.from_pretrained(checkpoint, dtype=torch_dtype).language_model
    else:
        lm = ConceptMoEForCausalLM.from_pretrained(checkpoint, dtype=torch_dtype)
    return lm.to(device).eval(), lm.config


def encode_text(tokenizer, text: str, max_tokens: int | None = None) -> tuple[list[int], int]:
    """Token ids of ``text`` (plain text) and the UTF-8 byte count of the part they cover."""
    enc = tokenizer(text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    if max_tokens is not None and len(ids) > max_tokens:
        ids, offsets = ids[:max_tokens], offsets[:max_tokens]
        covered = text[:offsets[-1][1]] if offsets else ""
    else:
        covered = text
    return ids, len(covered.encode("utf-8"))


def document_start_id(tokenizer) -> int:
    from vlm.modeling.chat_common import EOS_TOKEN

    vocab = tokenizer.get_vocab()
    if EOS_TOKEN in vocab:
        return vocab[EOS_TOKEN]
    for candidate in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return candidate
    raise ValueError("the tokenizer has no end-of-text / bos token to start the document with")


def score_stream(model, stream: list[int], seq_len: int, batch_size: int = 8, device: str = "cpu") -> dict:
    """Sum of next-token NLL over ``stream[1:]`` in windows of ``seq_len`` + boundary counts."""
    import torch

    from vlm.modeling.chunking import concept_counts

    windows = [stream[s:s + seq_len + 1] for s in range(0, len(stream) - 1, seq_len)]
    windows = [w for w in windows if len(w) >= 2]
    nll, tokens, concepts, counted = 0.0, 0, 0, 0
    full = [w for w in windows if len(w) == seq_len + 1]
    tail = [w for w in windows if len(w) != seq_len + 1]
    batches = [full[i:i + batch_size] for i in range(0, len(full), batch_size)] + [[w] for w in tail]
    with torch.no_grad():
        for batch in batches:
            ids = torch.tensor(batch, dtype=torch.long, device=device)
            out = model(input_ids=ids[:, :-1])
            logp = torch.log_softmax(out.logits.float(), dim=-1)
            nll -= float(logp.gather(-1, ids[:, 1:, None]).sum())
            tokens += ids[:, 1:].numel()
            if getattr(out, "boundary_mask", None) is not None:
                n = concept_counts(out.boundary_mask, torch.ones_like(ids[:, :-1], dtype=torch.bool))
                concepts += int(n["concepts"].sum())
                counted += int(n["tokens"].sum())
    return {"nll": nll, "tokens": tokens, "concepts": concepts, "tokens_in_chunker": counted}


def evaluate_text(checkpoint: str, text_path: str, seq_len: int | None = None, batch_size: int = 8,
                  max_tokens: int | None = None, tokenizer_dir: str | None = None, dtype: str = "float32",
                  device: str = "cpu") -> dict:
    """Score ``text_path`` with the checkpoint's language model; returns the numbers listed below.

    The checkpoint is an HF export folder: a VLM (``model_type: conceptmoe_vlm``; its
    ``language_model`` is scored) or a text-only ``ConceptMoEForCausalLM`` (``conceptmoe``), with the
    tokenizer files in the same folder (or ``--tokenizer DIR``).

    Method: the file is tokenised as plain text (special-token strings in it stay ordinary text),
    preceded by the end-of-text token as the document start, so every text token is predicted. The
    stream is cut into consecutive windows of ``--seq-len`` predicted tokens (each window sees only its
    own tokens as context: standard non-overlapping evaluation, which slightly overstates perplexity
    against a sliding window). The model runs in eval mode, where ConceptMoE boundaries are hard
    (``p >= 0.5``), exactly as in generation.

    Reported: ``tokens`` scored, ``bytes`` (UTF-8 bytes of the scored text), ``nll_per_token`` (nats),
    ``perplexity`` = exp(nll/token), ``bits_per_token``, ``bits_per_byte`` = total nll / (ln 2 x
    bytes) (tokenizer independent), and with chunking on: ``compression_ratio`` = tokens / concepts
    over all windows (R; ``target_ratio`` from the config for comparison) and ``concepts``.
    """
    from transformers import AutoTokenizer

    from vlm.modeling.chunking import achieved_ratio

    model, config = load_language_model(checkpoint, dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or checkpoint)
    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    ids, n_bytes = encode_text(tokenizer, text, max_tokens)
    if not ids:
        raise ValueError(f"{text_path}: no tokens")
    seq_len = int(seq_len or min(getattr(config, "max_position_embeddings", 1024) or 1024, 1024))
    start = time.time()
    raw = score_stream(model, [document_start_id(tokenizer)] + ids, seq_len, batch_size, device)
    nll, n = raw["nll"], raw["tokens"]
    result = {"checkpoint": checkpoint, "text": text_path, "tokens": n, "bytes": n_bytes, "seq_len": seq_len,
              "nll_per_token": nll / n, "perplexity": math.exp(nll / n), "bits_per_token": nll / n / math.log(2),
              "bits_per_byte": nll / math.log(2) / n_bytes, "seconds": round(time.time() - start, 2)}
    if getattr(config, "chunking", False) and raw["concepts"]:
        result.update({"compression_ratio": achieved_ratio(raw["tokens_in_chunker"], raw["concepts"]),
                       "concepts": raw["concepts"], "target_ratio": getattr(config, "target_ratio", None)})
    else:
        result.update({"compression_ratio": None, "concepts": None, "target_ratio": None})
    return result


TEXT_ONLY_TYPES = ("text",)  # data.datasets types of plain text (data_pipelines/sources.py)


def untrained_on_text_note(checkpoint: str) -> str | None:
    """One line when the run that exported ``checkpoint`` (its ``train_config.json``, one folder up: an export
    is ``runs/<name>/hf``) started from a random language model and trained on no text-only corpus: its
    perplexity on plain text then measures a model that never saw any. None when that is not known."""
    import yaml

    from eval_suites.common import REPO_ROOT

    path = os.path.join(os.path.dirname(os.path.abspath(checkpoint)), "train_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    model, data = cfg.get("model") or {}, cfg.get("data") or {}
    if model.get("llm") or model.get("init_from"):  # a pretrained language model: it has seen text
        return None
    datasets = data.get("datasets")
    if data.get("kind") == "synthetic":
        seen = "synthetic tokens only"
    else:
        if datasets is None and data.get("config"):
            config = data["config"] if os.path.isabs(data["config"]) else os.path.join(REPO_ROOT, data["config"])
            try:
                with open(config, encoding="utf-8") as f:
                    datasets = (yaml.safe_load(f) or {}).get("datasets")
            except (OSError, yaml.YAMLError):
                return None
        if not isinstance(datasets, list) or any(d.get("type") in TEXT_ONLY_TYPES for d in datasets):
            return None
        seen = ", ".join(f"{d.get('name') or d.get('path')} ({d.get('type')})" for d in datasets)
    return (f"note: this checkpoint's language model started from random weights and trained on no text-only "
            f"corpus ({seen}; {path}): it never saw plain text, so these figures are not those of a text model "
            f"(train with a text dataset, e.g. configs/data/default.yaml's shakespeare_train, to score text)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="HF export folder (VLM or text-only ConceptMoE)")
    parser.add_argument("--text", default="data/default/shakespeare_val.txt", help="held-out UTF-8 text file")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the checkpoint folder)")
    parser.add_argument("--seq-len", type=int, default=None, help="predicted tokens per window (default min(max_pos, 1024))")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of the file")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=None, help="cpu / cuda (default: cuda if available)")
    parser.add_argument("--cpu-threads", default="1",
                        help="torch threads on CPU, the trainer's cpu_threads (default 1); auto = OMP_NUM_THREADS, "
                             "else all cores")
    parser.add_argument("--json", default=None, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    from eval_suites.lmms_inputs import as_cpu_threads
    try:
        cpu_threads = as_cpu_threads(args.cpu_threads)
    except ValueError as err:
        parser.error(str(err).removeprefix("conceptmoe_vlm: ").replace("cpu_threads", "--cpu-threads"))

    problem = checkpoint_problem(args.checkpoint, need_processor=False, model_types=MODEL_TYPES)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if not os.path.isfile(args.text):
        print(f"error: text file not found: {args.text}", file=sys.stderr)
        return 2
    tok_dir = args.tokenizer or args.checkpoint
    if not os.path.isfile(os.path.join(tok_dir, "tokenizer_config.json")):
        print(f"error: no tokenizer in {tok_dir} (pass --tokenizer DIR)", file=sys.stderr)
        return 2
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        from vlm.config.threads import apply_cpu_threads

        print(f"[text_eval] {apply_cpu_threads(cpu_threads)}", flush=True)
    result = evaluate_text(args.checkpoint, args.text, args.seq_len, args.batch_size, args.max_tokens,
                           args.tokenizer, args.dtype, device)
    for key in ("tokens", "bytes", "seq_len", "nll_per_token", "perplexity", "bits_per_token", "bits_per_byte",
                "compression_ratio", "target_ratio", "concepts", "seconds"):
        value = result[key]
        print(f"{key:18s} {value:.4f}" if isinstance(value, float) else f"{key:18s} {value}")
    note = untrained_on_text_note(args.checkpoint)
    if note:
        print(note)
        result["note"] = note
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
