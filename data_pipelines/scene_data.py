"""Synthetic glyph scenes for the VLM compression study (issue 40): offline, deterministic from a seed.

Each 64x64 RGB scene (8x8 = 64 patches of the scene tower at 8x8 px) has a 2x2 quadrant layout of
4x4 patches each; a quadrant holds a coloured handwritten digit (sklearn's 8x8 digits, the default
task's own train / val / test split, so held-out scenes carry held-out handwriting), a coloured shape
or nothing, at a random place on the patch grid: small (a digit fills one patch) or large (2x, a digit
spans 2x2 patches), on a background of clutter level clean / low / high. Most of each quadrant is
background: the tokens a merge can spare. Questions by kind: identity,
position, counting, comparison, reading (two digits left to right), text (no image). Every record
carries the scene's metadata (clutter, glyph_size, glyphs) so accuracy can be split.

    python -m data_pipelines.scene_data --out data/scenes        (seconds; idempotent, --force rebuilds)
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import time

import numpy as np

IMAGE_SIZE = 64
QUADRANTS = ("top-left", "top-right", "bottom-left", "bottom-right")  # raster order of the 2x2 layout
COLOURS = {"red": (230, 40, 40), "green": (40, 210, 60), "blue": (60, 90, 240), "yellow": (235, 225, 40),
           "white": (240, 240, 240)}
CLUTTER = ("clean", "low", "high")
SIZES = ("small", "large")
KINDS = ("identity", "position", "counting", "comparison", "reading", "text", "describe")
TRAIN_ONLY_KINDS = ("describe",)  # in the train split only: never scored
CAPTIONS_FILE = "scenes_captions.json"  # the train split's captions alone (a first training stage)
SPLITS = {"train": (3000, 1), "val": (150, 2), "test": (400, 3)}  # scenes, seed offset (disjoint streams)
PATCH = 8  # the scene tower's patch (configs/model/vlm_scene_tiny.yaml): glyphs sit on its grid
DIGIT_THRESHOLD = 8  # of sklearn's 0..16 ink: the drawn strokes
SHAPES = {  # 5x5 bitmaps
    "square": ("11111", "10001", "10001", "10001", "11111"), "cross": ("00100", "00100", "11111", "00100", "00100"),
    "triangle": ("00100", "01010", "01010", "10001", "11111"), "diamond": ("00100", "01010", "10001", "01010", "00100"),
}


@functools.lru_cache(maxsize=1)
def _digit_arrays() -> tuple[np.ndarray, np.ndarray]:
    from data_pipelines.default_data import load_digits_arrays

    return load_digits_arrays()


def glyph_bitmap(glyph: dict) -> np.ndarray:
    """Bool[h, w] of a glyph at its scale: a digit is its sklearn image's strokes (8x8 per scale)."""
    if glyph["type"] == "digit":
        bm = _digit_arrays()[0][glyph["source"]] >= DIGIT_THRESHOLD
    else:
        bm = np.array([[c == "1" for c in r] for r in SHAPES[glyph["shape"]]], dtype=bool)
    s = glyph["scale"]
    return np.kron(bm, np.ones((s, s), dtype=bool))


def digit_pools() -> dict[str, np.ndarray]:
    """{split: sklearn digit indices} the scenes of that split draw their digits from."""
    from data_pipelines.default_data import digit_split_indices

    return digit_split_indices(len(_digit_arrays()[1]))


def sample_scene(rng: np.random.Generator, pool: np.ndarray) -> dict:
    """Scene metadata: clutter, glyph size and one entry per quadrant (None = empty); >= 2 digits, each
    an image of ``pool`` (sklearn digit indices)."""
    clutter = CLUTTER[int(rng.integers(len(CLUTTER)))]
    size = SIZES[int(rng.integers(len(SIZES)))]
    large = size == "large"
    while True:
        types = [rng.choice(["digit", "shape", "none"], p=[0.55, 0.3, 0.15]) for _ in QUADRANTS]
        if sum(t == "digit" for t in types) >= 2:
            break
    glyphs = []
    for q, t in enumerate(types):
        if t == "none":
            glyphs.append(None)
            continue
        g = {"quadrant": QUADRANTS[q], "type": str(t), "colour": list(COLOURS)[int(rng.integers(len(COLOURS)))]}
        if t == "digit":
            g["source"] = int(pool[int(rng.integers(len(pool)))])
            g["digit"] = int(_digit_arrays()[1][g["source"]])
            g["scale"] = 2 if large else 1
        else:
            g["shape"] = list(SHAPES)[int(rng.integers(len(SHAPES)))]
            g["scale"] = 3 if large else 1
        h, w = glyph_bitmap(g).shape
        half = IMAGE_SIZE // 2
        g["y"] = (q // 2) * half + PATCH * int(rng.integers(0, (half - h) // PATCH + 1))
        g["x"] = (q % 2) * half + PATCH * int(rng.integers(0, (half - w) // PATCH + 1))
        g["h"], g["w"] = h, w
        glyphs.append(g)
    return {"clutter": clutter, "glyph_size": size, "glyphs": glyphs,
            "background_seed": int(rng.integers(2**31))}


def render(scene: dict) -> np.ndarray:
    """uint8[IMAGE_SIZE, IMAGE_SIZE, 3]: background clutter (dim grey / dim colour specks, never as bright as a glyph),
    then the glyphs in their colours."""
    rng = np.random.default_rng(scene["background_seed"])
    img = np.full((IMAGE_SIZE, IMAGE_SIZE, 3), 20, dtype=np.uint8)
    level = CLUTTER.index(scene["clutter"])
    if level:
        density = (0.12, 0.35)[level - 1]
        specks = rng.random((IMAGE_SIZE, IMAGE_SIZE)) < density
        tint = rng.integers(40, 110, size=(IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.int64).astype(np.uint8)
        img[specks] = tint[specks]
        if level == 2:  # dim streaks across quadrants
            for _ in range(3):
                r = int(rng.integers(IMAGE_SIZE))
                img[r, :, :] = rng.integers(50, 100, size=3)
    for g in scene["glyphs"]:
        if g is None:
            continue
        bm = glyph_bitmap(g)
        patch = img[g["y"]:g["y"] + g["h"], g["x"]:g["x"] + g["w"]]
        patch[bm] = COLOURS[g["colour"]]
    return img


def glyph_cells(scene: dict, grid: tuple[int, int], image_size: int) -> np.ndarray:
    """Bool[gh * gw]: which cells of the token grid (raster order) contain a glyph pixel; the scene's
    mask (drawn at ``IMAGE_SIZE``) is enlarged to the tower's ``image_size`` (a multiple of it)."""
    mask = np.zeros((IMAGE_SIZE, IMAGE_SIZE), dtype=bool)
    for g in scene["glyphs"]:
        if g is not None:
            mask[g["y"]:g["y"] + g["h"], g["x"]:g["x"] + g["w"]] |= glyph_bitmap(g)
    if image_size % IMAGE_SIZE:
        raise ValueError(f"the tower's input ({image_size} px) is no multiple of the scenes' {IMAGE_SIZE} px")
    scale = image_size // IMAGE_SIZE
    mask = np.kron(mask, np.ones((scale, scale), dtype=bool))
    gh, gw = grid
    return mask.reshape(gh, image_size // gh, gw, image_size // gw).any(axis=(1, 3)).reshape(-1)


def _digits(scene: dict) -> list[dict]:
    return [g for g in scene["glyphs"] if g is not None and g["type"] == "digit"]


def questions(scene: dict, rng: np.random.Generator) -> list[tuple[str, str, str]]:
    """(kind, question, answer) for one scene: one of each image kind that the scene supports."""
    out = []
    digits = _digits(scene)
    g = digits[int(rng.integers(len(digits)))]
    out.append(("identity", f"Which digit is in the {g['quadrant']}?", str(g["digit"])))
    unique = [d for d in digits if sum(e["digit"] == d["digit"] for e in digits) == 1]
    if unique:
        g = unique[int(rng.integers(len(unique)))]
        out.append(("position", f"Where is the {g['digit']}?", g["quadrant"]))
    if rng.random() < 0.5:
        n = len(digits)
        out.append(("counting", "How many digits are there?", str(n)))
    else:
        colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
        n = sum(1 for e in scene["glyphs"] if e is not None and e["colour"] == colour)
        out.append(("counting", f"How many {colour} glyphs are there?", str(n)))
    distinct = [(a, b) for i, a in enumerate(digits) for b in digits[i + 1:] if a["digit"] != b["digit"]]
    if distinct:
        a, b = distinct[int(rng.integers(len(distinct)))]
        if rng.random() < 0.5:
            a, b = b, a
        bigger = a if a["digit"] > b["digit"] else b
        out.append(("comparison", f"Which digit is larger, the {a['quadrant']} or the {b['quadrant']}?",
                    bigger["quadrant"]))
    rows = [(row, [scene["glyphs"][2 * i], scene["glyphs"][2 * i + 1]]) for i, row in enumerate(("top", "bottom"))]
    rows = [(row, pair) for row, pair in rows if all(p is not None and p["type"] == "digit" for p in pair)]
    if rows:
        row, (left, right) = rows[int(rng.integers(len(rows)))]
        out.append(("reading", f"What number do the {row} digits read?", f"{left['digit']}{right['digit']}"))
    return out


def describe(scene: dict) -> str:
    """The scene's caption, quadrant by quadrant in raster order: "top-left: red 3. top-right: nothing. ..."."""
    parts = []
    for q, g in zip(QUADRANTS, scene["glyphs"]):
        what = "nothing" if g is None else f"{g['colour']} {g['digit'] if g['type'] == 'digit' else g['shape']}"
        parts.append(f"{q}: {what}.")
    return " ".join(parts)


def text_question(rng: np.random.Generator) -> tuple[str, str, str]:
    """The text-only control: the same comparison skill with no image."""
    a, b = (int(x) for x in rng.choice(10, size=2, replace=False))
    return "text", f"Which is larger, {a} or {b}?", str(max(a, b))


def build_split(out: str, split: str, n_scenes: int, seed: int, text_share: float = 0.15,
                captions: bool = False) -> list[dict]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pool = digit_pools()[split]
    os.makedirs(os.path.join(out, "images", "scenes"), exist_ok=True)
    records = []
    for i in range(n_scenes):
        scene = sample_scene(rng, pool)
        name = f"scenes/{split}-{i}.png"
        Image.fromarray(render(scene), mode="RGB").save(os.path.join(out, "images", name))
        meta = {"clutter": scene["clutter"], "glyph_size": scene["glyph_size"],
                "glyphs": scene["glyphs"], "background_seed": scene["background_seed"]}
        asked = questions(scene, rng)
        if captions:  # training-only: dense supervision of every quadrant (LLaVA's stage-1 captions)
            asked.append(("describe", "Describe the scene.", describe(scene)))
        for kind, question, answer in asked:
            records.append({"id": f"{split}-{i}-{kind}", "kind": kind, "image": name,
                            "clutter": scene["clutter"], "glyph_size": scene["glyph_size"],
                            "group": f"{kind}|{scene['clutter']}|{scene['glyph_size']}", "scene": meta,
                            "conversations": [{"from": "human", "value": f"<image>\n{question}"},
                                              {"from": "gpt", "value": answer}]})
        if rng.random() < text_share * 5:  # ~text_share of the records (about 5 image questions a scene)
            kind, question, answer = text_question(rng)
            records.append({"id": f"{split}-{i}-text", "kind": kind, "clutter": "none", "glyph_size": "none",
                            "group": "text|none|none",
                            "conversations": [{"from": "human", "value": question},
                                              {"from": "gpt", "value": answer}]})
    order = np.random.default_rng(seed + 1000).permutation(len(records))  # kinds interleaved in file order
    return [records[int(j)] for j in order]


def build(out: str, seed: int = 0, sizes: dict | None = None, force: bool = False, quiet: bool = False) -> dict | None:
    """Write ``scenes_{train,val,test}.json``, ``scenes_captions.json`` (the train split's captions alone) +
    ``images/scenes/`` into ``out`` (``.built`` last); the counts,
    or None when already built. ``sizes``: {split: number of scenes} (default ``SPLITS``)."""
    out = os.path.abspath(out)
    if os.path.isfile(os.path.join(out, ".built")) and not force:
        return None
    staging = f"{out}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    counts = {}
    try:
        for split, (n, offset) in SPLITS.items():
            n = (sizes or {}).get(split, n)
            records = build_split(staging, split, n, seed * 100 + offset, captions=split == "train")
            with open(os.path.join(staging, f"scenes_{split}.json"), "w", encoding="utf-8") as f:
                json.dump(records, f, indent=0)
            if split == "train":  # the captions alone: a first training stage (LLaVA's stage 1)
                with open(os.path.join(staging, CAPTIONS_FILE), "w", encoding="utf-8") as f:
                    json.dump([r for r in records if r["kind"] in TRAIN_ONLY_KINDS], f, indent=0)
            counts[split] = {"scenes": n, "records": len(records),
                             "kinds": {k: sum(r["kind"] == k for r in records) for k in KINDS}}
        with open(os.path.join(staging, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump({"seed": seed, "image_size": IMAGE_SIZE, "counts": counts}, f, indent=1)
        with open(os.path.join(staging, ".built"), "w") as f:
            f.write(time.strftime("%Y-%m-%dT%H:%M:%S") + "\n")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if os.path.exists(out):
        shutil.rmtree(out)
    os.replace(staging, out)
    if not quiet:
        print(f"built {out}: " + ", ".join(f"{s}={c['records']} records/{c['scenes']} scenes" for s, c in counts.items()))
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="data/scenes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    if build(args.out, seed=args.seed, force=args.force) is None:
        print(f"{args.out} is already built (found .built); nothing to do")
    return 0


if __name__ == "__main__":
    sys.exit(main())
