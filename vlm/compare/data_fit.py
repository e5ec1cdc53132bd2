"""The VLM study's same data: every training record of every stage fits a ``max_length`` row with every
arm's image tokens (a record that does not is cut by the collator for the arms with many image tokens
only, 64 vs 16 per image, so the arms would learn from different text: the study refuses to start
instead, one line, exit 2, naming the ``max_length`` that fits), and the report's section that checks
the arms' training samples hashed alike per seed."""
from __future__ import annotations

import json
import os
from pathlib import Path

from vlm.compare.config import CompareError, rel, repo_path


def _stage_data(train: dict) -> tuple[int, list[Path]]:
    """(max_length, llava_json files) of one stage's training YAML, read as the trainer reads it."""
    from vlm.config.train import load_train_config
    from vlm.training.data import data_config

    data = data_config(load_train_config(raw=train))
    root = data.get("root")
    files = [Path(os.path.normpath(repo_path(Path(root) / d["path"] if root else d["path"])))
             for d in data["datasets"] if d.get("type") == "llava_json" and float(d.get("weight", 1.0)) > 0]
    missing = next((f for f in files if not f.is_file()), None)
    if missing is not None:
        raise CompareError(f"data: training file not found: {missing}")
    return int(data.get("max_length", 512)), files


def longest_records(files: list[Path], tokenizer_dir: str, image_tokens: int) -> dict[str, dict]:
    """Per file: the record that is longest with ``image_tokens`` per image (chat template and BOS
    included), as {"id", "tokens"}. Records are tokenized with one token per image and the
    rest added, as ``<im_start> <image>*P <im_end>`` grows by P - 1."""
    from transformers import AutoTokenizer

    from vlm.modeling.chat_template import ChatTokenizer

    chat = ChatTokenizer(AutoTokenizer.from_pretrained(tokenizer_dir), num_image_tokens=1)
    out = {}
    for path in files:
        best = None
        for i, rec in enumerate(json.loads(path.read_text())):
            if "conversations" not in rec:
                continue
            image = rec.get("image")
            n_img = 0 if image is None else 1 if isinstance(image, str) else len(image)
            ids, _ = chat.encode_conversation(rec["conversations"], str(rec.get("id", i)), num_images=n_img)
            length = len(ids) + n_img * (image_tokens - 1)
            if best is None or length > best["tokens"]:
                best = {"id": str(rec.get("id", i)), "tokens": length}
        if best:
            out[str(path)] = best
    return out


def check_rows_fit(stages: list[tuple[str, dict]], image_tokens: dict[str, int], tokenizer_dir: str) -> list[dict]:
    """``stages``: (name, training YAML) per stage; ``image_tokens``: arm id -> image tokens per image.
    Returns one row per stage and file (longest record, its length with the most image tokens, max_length);
    raises CompareError when a record does not fit some arm's row (the arm with the most image tokens has
    the longest rows)."""
    arm, most = max(image_tokens.items(), key=lambda kv: kv[1])
    rows = []
    for stage, train in stages:
        max_length, files = _stage_data(train)
        for path, rec in longest_records(files, tokenizer_dir, most).items():
            rows.append({"stage": stage, "file": rel(Path(path)), "record": rec["id"], "tokens": rec["tokens"],
                         "max_length": max_length, "arm": arm})
            if rec["tokens"] > max_length:
                raise CompareError(
                    f"data: {stage} stage: record {rec['id']} of {rel(Path(path))} is {rec['tokens']} tokens with arm "
                    f"{arm}'s {most} image tokens, over data.max_length {max_length}: the arms would train on "
                    f"differently cut samples; set train.data.max_length to at least {rec['tokens']}")
    return rows


def check_study(cfg: dict, raw: dict) -> list[dict]:
    """``check_rows_fit`` for a VLM study: its stages (``first_stage`` over ``raw``, then ``raw``) and its arms'
    image tokens per image (projector merge over the tower's patch grid)."""
    from vlm.compare import vlm_match
    from vlm.compare.jobs import first_stage

    grid = vlm_match.patch_grid(cfg["vlm"]["vision"])
    tokens = {a["id"]: vlm_match.image_tokens(cfg, a, grid) for a in cfg["arms"]}
    first = first_stage(cfg, raw)
    stages = ([("first", first)] if first else []) + [("second" if first else "training", raw)]
    return check_rows_fit(stages, tokens, str(repo_path(raw["model"]["tokenizer"])))


def same_data_section(results: list[dict], seeds: list[int], fit: list[dict] | None) -> tuple[list[dict], list[str]]:
    """Per seed, whether every arm's text fingerprint (its samples' text tokens in training order) is one;
    with ``fit`` (``check_study``'s rows) -> (checks, the report's "Same data, same steps" lines)."""
    checks = []
    for seed in seeds:
        fps = {r.get("text_fingerprint") for r in results if r["seed"] == seed}
        if fps:
            checks.append({"seed": seed, "same_samples": len(fps) == 1 and None not in fps,
                           "text_fingerprint": sorted(str(f) for f in fps)})
    if not checks:
        return checks, []
    md = ["", "## Same data, same steps", ""]
    md += [f"- seed {d['seed']}: the samples' text tokens in training order (image placeholders and padding "
           f"left out) hash {'identically' if d['same_samples'] else '**DIFFERENTLY**'} across arms "
           f"({', '.join(d['text_fingerprint'])})" for d in checks]
    md += [f"- {fit_line(f)} (`vlm.compare.data_fit`)" for f in fit or []]
    return checks, md


def fit_line(row: dict) -> str:
    """One ``check_rows_fit`` row in words (the CLI's log line, the report's same-data section)."""
    return (f"{row['stage']} stage: the longest record of `{row['file']}` is {row['tokens']} tokens with arm "
            f"{row['arm']}'s image tokens; rows of {row['max_length']}: no sample is cut")
