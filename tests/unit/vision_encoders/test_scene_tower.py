"""The scene tower's pretraining (vision_encoders/scene_tower.py): per-patch labels against the drawn strokes,
quadrant ids, a short run whose file loads exactly through ``vision.pretrained``, and the CLI's one-line errors."""

import json

import numpy as np
import pytest
import torch
import yaml

from data_pipelines.scene_data import (
    COLOURS,
    SHAPES,
    digit_pools,
    glyph_cells,
    render,
    sample_scene,
)
from vision_encoders import scene_tower
from vlm.modeling.vision_base import VisionEncoderConfig
from vlm.modeling.vision_registry import build_vision_encoder

SCENE_VISION = {"backbone": "tiny-vit", "image_size": 64, "model_kwargs": {"patch_size": 8}}


@pytest.mark.parametrize("image_size,patch", [(64, 8), (64, 4), (128, 8)])
def test_patch_labels_follow_each_glyphs_strokes(image_size, patch):
    rng = np.random.default_rng(3)
    grid = (image_size // patch, image_size // patch)
    for _ in range(20):
        scene = sample_scene(rng, digit_pools()["train"])
        cls_P, colour_P = scene_tower.patch_labels(scene, grid, image_size)
        assert np.array_equal(cls_P > 0, glyph_cells(scene, grid, image_size))
        assert np.array_equal(cls_P > 0, colour_P > 0)
        for g in scene["glyphs"]:
            if g is None:
                continue
            cells_P = glyph_cells({"glyphs": [g]}, grid, image_size)
            name = str(g["digit"]) if g["type"] == "digit" else g["shape"]
            assert {scene_tower.GLYPH_CLASSES[c] for c in cls_P[cells_P]} == {name}
            assert {scene_tower.COLOUR_CLASSES[c] for c in colour_P[cells_P]} == {g["colour"]}


def test_patch_labels_mark_only_drawn_pixels():
    """A labelled patch holds a glyph colour in the rendered image; an unlabelled one holds none."""
    rng = np.random.default_rng(5)
    colours = np.array(list(COLOURS.values()))
    for _ in range(10):
        scene = sample_scene(rng, digit_pools()["train"])
        img = render(scene)
        cls_P, _ = scene_tower.patch_labels(scene, (8, 8), 64)
        cells = img.reshape(8, 8, 8, 8, 3).transpose(0, 2, 1, 3, 4).reshape(64, 64, 3)
        glyph_px = (cells[:, :, None, :] == colours[None, None]).all(-1).any(-1)  # [patch, pixel]
        assert np.array_equal(glyph_px.any(-1), cls_P > 0)


def test_quadrant_ids():
    q = scene_tower.quadrant_ids((4, 4)).view(4, 4)
    assert q.tolist() == [[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 3, 3], [2, 2, 3, 3]]
    assert len(scene_tower.GLYPH_CLASSES) == 11 + len(SHAPES)


def _probe_loss(encoder, batch, quad_P) -> float:
    """Loss of fresh patch heads fitted for 30 steps on ``encoder``'s frozen tokens of ``batch``."""
    torch.manual_seed(0)
    heads = scene_tower.PatchHeads(encoder.embed_dim)
    opt = torch.optim.AdamW(heads.parameters(), lr=1e-2)
    with torch.no_grad():
        tokens_BPD = encoder.eval()(batch[0])
    for _ in range(30):
        glyph, colour, quad = heads(tokens_BPD)
        ce = torch.nn.functional.cross_entropy
        loss = (ce(glyph.flatten(0, 1), batch[1].flatten()) + ce(colour.flatten(0, 1), batch[2].flatten())
                + ce(quad.flatten(0, 1), quad_P.expand_as(batch[1]).flatten()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def test_pretrained_file_loads_exactly_and_reads_patches(tmp_path):
    vision = VisionEncoderConfig(**SCENE_VISION)
    quad_P = scene_tower.quadrant_ids((8, 8))
    encoder, summary = scene_tower.pretrain(vision, steps=60, batch=16, eval_scenes=8, progress=False)
    out = tmp_path / "tower.safetensors"
    scene_tower.save(encoder, out, summary)
    assert json.loads(out.with_suffix(".json").read_text())["steps"] == 60
    assert set(summary["held_out_accuracy"]) == {"glyph", "colour", "quadrant"}
    loaded = build_vision_encoder(VisionEncoderConfig(**SCENE_VISION, pretrained=str(out)))
    assert f"file {out}" in loaded.load_line
    trained, reloaded = encoder.model.state_dict(), loaded.model.state_dict()
    assert trained.keys() == reloaded.keys()
    for k in trained:
        assert torch.equal(trained[k], reloaded[k]), k
    # fresh linear heads read held-out patches better from the pretrained tower than from a random one
    torch.manual_seed(1)
    random_tower = build_vision_encoder(vision)
    batch = scene_tower.SceneBatches(random_tower, "test", seed=7)(32)
    assert _probe_loss(loaded, batch, quad_P) < 0.9 * _probe_loss(random_tower, batch, quad_P)


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert scene_tower.main(["--preset", str(tmp_path / "missing.yaml"), "--steps", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err
    no_vision = tmp_path / "text_only.yaml"
    no_vision.write_text(yaml.safe_dump({"text_preset": "tiny.yaml"}))
    assert scene_tower.main(["--preset", str(no_vision), "--steps", "0"]) == 2
    assert "no 'vision' section" in capsys.readouterr().err


def test_vision_section_clears_pretrained(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text(yaml.safe_dump({"vision": {**SCENE_VISION, "pretrained": "data/scenes/tower.safetensors"}}))
    assert scene_tower.vision_section(str(preset)).pretrained is None
    with pytest.raises(ValueError, match="must be null"):
        scene_tower.pretrain(VisionEncoderConfig(**SCENE_VISION, pretrained=str(preset)), steps=1)
