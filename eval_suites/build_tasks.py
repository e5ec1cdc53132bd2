"""Parquet files for the offline lmms-eval tasks, made from the embedded default data.

``cmoe_digits_vqa`` / ``cmoe_digits_mc`` read them (the default data's test split, images embedded)
through ``CMOE_DATA_DIR``.

    python -m eval_suites.build_tasks --data data/default --out data/default/eval   (idempotent)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

BUILDER_VERSION = 1
SPLIT = "test"
VQA_FILE = "digits_vqa_test.parquet"
MC_FILE = "digits_mc_test.parquet"
MANIFEST = "manifest.json"
DIGIT_CHOICES = [str(d) for d in range(10)]
MC_QUESTION = "What digit is this?"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _turns(record: dict) -> tuple[str, str]:
    turns = record["conversations"]
    question = next(t["value"] for t in turns if t.get("from", t.get("role")) in ("human", "user"))
    answer = next(t["value"] for t in turns if t.get("from", t.get("role")) in ("gpt", "assistant"))
    return question.replace("<image>", "").strip(), answer.strip()


def _kind(record_id: str) -> str:
    return record_id.rsplit("-", 1)[-1] if "-" in record_id else "all"


def is_current(data: str, out: str) -> bool:
    """True when ``out`` holds files built by this builder version from the current source JSON."""
    path = os.path.join(out, MANIFEST)
    source = os.path.join(data, f"digits_{SPLIT}.json")
    if not (os.path.isfile(path) and os.path.isfile(source)):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return False
    return (manifest.get("builder_version") == BUILDER_VERSION
            and manifest.get("source_sha256") == _sha256(source)
            and all(os.path.isfile(os.path.join(out, name)) for name in (VQA_FILE, MC_FILE)))


def build(data: str = "data/default", out: str | None = None, force: bool = False, quiet: bool = False) -> dict | None:
    """Write the parquet files; return the manifest, or None when they were already current.

    ``digits_vqa_test.parquet``: one row per test record (id, image, question, answer, kind,
    image_file); ``digits_mc_test.parquet``: one row per test image, "What digit is this?" with the
    ten digits as choices; ``manifest.json`` (row counts, source sha256, builder version) last.
    """
    say = (lambda *a: None) if quiet else print
    out = out or os.path.join(data, "eval")
    source = os.path.join(data, f"digits_{SPLIT}.json")
    if not os.path.isfile(source):
        raise FileNotFoundError(f"{source} not found: build the default data first "
                                f"(make data, or python -m data_pipelines.default_data --out {data})")
    if not force and is_current(data, out):
        say(f"{out} is up to date; nothing to do")
        return None
    import datasets

    start = time.time()
    with open(source, encoding="utf-8") as f:
        records = json.load(f)
    image_root = os.path.join(data, "images")
    png_cache: dict[str, bytes] = {}

    def png(rel: str) -> dict:
        if rel not in png_cache:
            path = os.path.join(image_root, rel)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"image {path} (referenced by {source}) is missing")
            with open(path, "rb") as fh:
                png_cache[rel] = fh.read()
        return {"bytes": png_cache[rel], "path": None}

    vqa = {k: [] for k in ("id", "image", "question", "answer", "kind", "image_file")}
    mc = {k: [] for k in ("id", "image", "question", "choices", "answer", "label", "image_file")}
    for record in records:
        if not record.get("image"):
            continue
        question, answer = _turns(record)
        kind = _kind(str(record["id"]))
        for key, val in (("id", str(record["id"])), ("image", png(record["image"])), ("question", question),
                         ("answer", answer), ("kind", kind), ("image_file", record["image"])):
            vqa[key].append(val)
        if kind == "digit" and answer in DIGIT_CHOICES:
            for key, val in (("id", str(record["id"])), ("image", png(record["image"])), ("question", MC_QUESTION),
                             ("choices", list(DIGIT_CHOICES)), ("answer", answer),
                             ("label", DIGIT_CHOICES.index(answer)), ("image_file", record["image"])):
                mc[key].append(val)
    if not vqa["id"] or not mc["id"]:
        raise ValueError(f"{source}: no image records with a digit question found")

    Value, Image = datasets.Value, datasets.Image
    vqa_features = datasets.Features({"id": Value("string"), "image": Image(), "question": Value("string"),
                                      "answer": Value("string"), "kind": Value("string"),
                                      "image_file": Value("string")})
    mc_features = datasets.Features({"id": Value("string"), "image": Image(), "question": Value("string"),
                                     "choices": datasets.Sequence(Value("string")), "answer": Value("string"),
                                     "label": Value("int64"), "image_file": Value("string")})
    os.makedirs(out, exist_ok=True)
    for name, columns, features in ((VQA_FILE, vqa, vqa_features), (MC_FILE, mc, mc_features)):
        tmp = os.path.join(out, f".{name}.{os.getpid()}.tmp")
        datasets.Dataset.from_dict(columns, features=features).to_parquet(tmp)
        os.replace(tmp, os.path.join(out, name))
    manifest = {"builder_version": BUILDER_VERSION, "source": os.path.abspath(source),
                "source_sha256": _sha256(source), "split": SPLIT,
                "files": {VQA_FILE: len(vqa["id"]), MC_FILE: len(mc["id"])},
                "built": time.strftime("%Y-%m-%dT%H:%M:%S")}
    tmp = os.path.join(out, f".{MANIFEST}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
    os.replace(tmp, os.path.join(out, MANIFEST))  # the stamp goes last
    say(f"built {out} in {time.time() - start:.1f}s: {VQA_FILE} ({len(vqa['id'])} rows), "
        f"{MC_FILE} ({len(mc['id'])} rows)")
    return manifest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="data/default", help="default-data folder (digits_test.json, images/)")
    parser.add_argument("--out", default=None, help="output folder (default: <data>/eval)")
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    args = parser.parse_args(argv)
    try:
        build(args.data, args.out, force=args.force)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
