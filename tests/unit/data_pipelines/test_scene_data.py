"""data_pipelines.scene_data (issue 40): deterministic from a seed, every question kind present, answers
re-derived from the scene metadata (independently of the generator's own code) and from the pixels, and
the tiny ViT at the scene resolution sees >= 64 patches."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from data_pipelines import scene_data as sd

SIZES = {"train": 12, "val": 4, "test": 8}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("scenes")
    sd.build(str(out / "a"), seed=5, sizes=SIZES, quiet=True)
    return out


def _digest(folder: Path) -> str:
    h = hashlib.sha1()
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name not in (".built",):
            h.update(p.relative_to(folder).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def test_deterministic_from_seed(built):
    sd.build(str(built / "b"), seed=5, sizes=SIZES, quiet=True)
    sd.build(str(built / "c"), seed=6, sizes=SIZES, quiet=True)
    assert _digest(built / "a") == _digest(built / "b")
    assert _digest(built / "a") != _digest(built / "c")


def test_splits_are_disjoint_scenes(built):
    scenes = {s: {json.dumps(r["scene"], sort_keys=True) for r in json.loads((built / "a" / f"scenes_{s}.json")
                                                                               .read_text()) if "scene" in r}
              for s in SIZES}
    assert not scenes["train"] & scenes["test"] and not scenes["train"] & scenes["val"]


def _quadrant_of(g):  # from the glyph's pixel box, not its recorded quadrant
    half = sd.IMAGE_SIZE // 2
    row = "top" if g["y"] + g["h"] <= half else "bottom"
    col = "left" if g["x"] + g["w"] <= half else "right"
    return f"{row}-{col}"


def _rederive(question: str, scene: dict) -> str:
    glyphs = [g for g in scene["glyphs"] if g is not None]
    where = {_quadrant_of(g): g for g in glyphs}
    digits = [g for g in glyphs if g["type"] == "digit"]
    if question.startswith("Which digit is in the "):
        return str(where[question[len("Which digit is in the "):-1]]["digit"])
    if question.startswith("Where is the "):
        d = int(question[len("Where is the "):-1])
        (hit,) = [g for g in digits if g["digit"] == d]
        return _quadrant_of(hit)
    if question == "How many digits are there?":
        return str(len(digits))
    if question.startswith("How many "):
        colour = question.split()[2]
        return str(sum(g["colour"] == colour for g in glyphs))
    if question.startswith("Which digit is larger, the "):
        a, b = question[len("Which digit is larger, the "):-1].split(" or the ")
        return a if where[a]["digit"] > where[b]["digit"] else b
    if question.startswith("What number do the "):
        row = question.split()[4]
        return f"{where[row + '-left']['digit']}{where[row + '-right']['digit']}"
    if question == "Describe the scene.":
        names = {q: f"{g['colour']} {g['digit'] if g['type'] == 'digit' else g['shape']}" for q, g in where.items()}
        return " ".join(f"{q}: {names.get(q, 'nothing')}." for q in
                        ("top-left", "top-right", "bottom-left", "bottom-right"))
    raise AssertionError(f"unknown question {question!r}")


def test_kinds_and_answers_by_construction(built):
    from PIL import Image

    records = json.loads((built / "a" / "scenes_train.json").read_text())
    assert {r["kind"] for r in records} == set(sd.KINDS)
    held_out = json.loads((built / "a" / "scenes_test.json").read_text())
    assert {r["kind"] for r in held_out} == set(sd.KINDS) - set(sd.TRAIN_ONLY_KINDS)
    captions = json.loads((built / "a" / sd.CAPTIONS_FILE).read_text())  # the first stage's data
    assert captions == [r for r in records if r["kind"] in sd.TRAIN_ONLY_KINDS]
    assert len(captions) == SIZES["train"]  # one caption per training scene
    for r in records:
        question, answer = r["conversations"][0]["value"], r["conversations"][1]["value"]
        if r["kind"] == "text":
            assert "image" not in r and "<image>" not in question
            a, b = (int(x) for x in question[len("Which is larger, "):-1].split(" or "))
            assert answer == str(max(a, b))
            continue
        assert question.startswith("<image>\n") and r["clutter"] in sd.CLUTTER and r["glyph_size"] in sd.SIZES
        assert _rederive(question[len("<image>\n"):], r["scene"]) == answer, r["id"]
        pixels = np.asarray(Image.open(built / "a" / "images" / r["image"]).convert("RGB"))
        for g in r["scene"]["glyphs"]:
            if g is None:
                continue
            box = pixels[g["y"]:g["y"] + g["h"], g["x"]:g["x"] + g["w"]]
            assert (box[sd.glyph_bitmap(g)] == sd.COLOURS[g["colour"]]).all()  # the glyph is drawn where recorded


def test_clutter_is_dimmer_than_glyphs():
    rng = np.random.default_rng(0)
    for _ in range(20):
        scene = sd.sample_scene(rng, sd.digit_pools()["train"])
        scene["glyphs"] = [None] * 4
        assert sd.render(scene).max() < min(max(c) for c in sd.COLOURS.values())


def test_scene_preset_patch_count():
    from vlm.modeling.configuration_conceptmoe_vl import ConceptMoEVLMConfig
    from vlm.modeling.vision_base import VisionEncoderConfig
    from vlm.modeling.vision_registry import build_vision_encoder

    root = Path(__file__).resolve().parents[3]
    cfg = ConceptMoEVLMConfig.from_yaml(root / "configs" / "model" / "vlm_scene_tiny.yaml")
    enc = build_vision_encoder(VisionEncoderConfig(**cfg.vision))
    assert enc.num_patches >= 64 and enc.image_size == sd.IMAGE_SIZE


def test_held_out_scenes_carry_held_out_handwriting(built):
    """Each split's digits come from the default task's same split: no test handwriting in training."""
    pools = {s: set(int(i) for i in idx) for s, idx in sd.digit_pools().items()}
    for split in SIZES:
        sources = {g["source"] for r in json.loads((built / "a" / f"scenes_{split}.json").read_text())
                   if "scene" in r for g in r["scene"]["glyphs"] if g is not None and g["type"] == "digit"}
        assert sources and sources <= pools[split], split


def test_glyphs_sit_on_the_patch_grid(built):
    for r in json.loads((built / "a" / "scenes_train.json").read_text()):
        for g in r.get("scene", {"glyphs": []})["glyphs"]:
            if g is not None:
                assert g["y"] % sd.PATCH == 0 and g["x"] % sd.PATCH == 0, r["id"]
