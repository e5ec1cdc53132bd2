"""Pretrain the scene tower of the VLM study (issue 40): the preset's ViT learns, for every patch, which glyph
covers it (background, digit 0-9 or shape), the glyph's colour and the patch's quadrant, on scenes drawn afresh
each step from the training split's handwriting (``data_pipelines.scene_data``). It stands in for the pretrained
ViT a real VLM starts from (CLIP / SigLIP patch features know what is drawn where); the study's presets load the
file through ``vision.pretrained``. Held-out accuracy is measured on scenes of the test split's handwriting.

    python -m vision_encoders.scene_tower --preset configs/model/vlm_scene_tiny.yaml --out data/scenes/tower.safetensors
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from torch import nn

from data_pipelines.scene_data import (
    COLOURS,
    SHAPES,
    digit_pools,
    glyph_cells,
    render,
    sample_scene,
)
from vlm.modeling.vision_base import VisionEncoder, VisionEncoderConfig
from vlm.modeling.vision_registry import build_vision_encoder

log = logging.getLogger(__name__)
GLYPH_CLASSES = ("background", *(str(d) for d in range(10)), *SHAPES)  # per-patch "what" target
COLOUR_CLASSES = ("background", *COLOURS)


def glyph_class(glyph: dict) -> int:
    return 1 + glyph["digit"] if glyph["type"] == "digit" else GLYPH_CLASSES.index(glyph["shape"])


def patch_labels(scene: dict, grid: tuple[int, int], image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(glyph class, colour class) per patch, Int[gh * gw] each in raster order; 0 where no stroke is drawn."""
    cls_P = np.zeros(grid[0] * grid[1], dtype=np.int64)
    colour_P = np.zeros_like(cls_P)
    for g in scene["glyphs"]:
        if g is None:
            continue
        cells_P = glyph_cells({"glyphs": [g]}, grid, image_size)
        cls_P[cells_P] = glyph_class(g)
        colour_P[cells_P] = COLOUR_CLASSES.index(g["colour"])
    return cls_P, colour_P


def quadrant_ids(grid: tuple[int, int]) -> torch.Tensor:
    """Int[gh * gw]: the quadrant (raster order of the 2x2 layout) of each patch."""
    gh, gw = grid
    rows_P = torch.arange(gh).repeat_interleave(gw)
    cols_P = torch.arange(gw).repeat(gh)
    return (rows_P >= gh // 2).long() * 2 + (cols_P >= gw // 2).long()


class SceneBatches:
    """Scenes sampled from one split's handwriting pool: pixels [B, 3, S, S] through the tower's transform,
    glyph and colour labels [B, P]."""

    def __init__(self, encoder: VisionEncoder, split: str, seed: int) -> None:
        from PIL import Image

        self._image = Image.fromarray
        self.transform, self.grid, self.size = encoder.image_transform(), encoder.patch_grid, encoder.image_size
        self.rng, self.pool = np.random.default_rng(seed), digit_pools()[split]

    def __call__(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pixels, cls, colour = [], [], []
        for _ in range(n):
            scene = sample_scene(self.rng, self.pool)
            pixels.append(self.transform(self._image(render(scene), mode="RGB")))
            c, k = patch_labels(scene, self.grid, self.size)
            cls.append(c)
            colour.append(k)
        return torch.stack(pixels), torch.from_numpy(np.stack(cls)), torch.from_numpy(np.stack(colour))


class PatchHeads(nn.Module):
    """Linear read-outs of every patch token: glyph class, colour, quadrant (dropped after pretraining)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.glyph = nn.Linear(dim, len(GLYPH_CLASSES))
        self.colour = nn.Linear(dim, len(COLOUR_CLASSES))
        self.quadrant = nn.Linear(dim, 4)

    def forward(self, tokens_BPD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.glyph(tokens_BPD), self.colour(tokens_BPD), self.quadrant(tokens_BPD)


def losses(encoder: VisionEncoder, heads: PatchHeads, pixels, cls_BP, colour_BP, quad_P) -> dict[str, torch.Tensor]:
    glyph_BPC, colour_BPC, quad_BPC = heads(encoder(pixels))
    ce = nn.functional.cross_entropy
    return {"glyph": ce(glyph_BPC.flatten(0, 1), cls_BP.flatten()),
            "colour": ce(colour_BPC.flatten(0, 1), colour_BP.flatten()),
            "quadrant": ce(quad_BPC.flatten(0, 1), quad_P.expand_as(cls_BP).flatten())}


@torch.no_grad()
def accuracy(encoder: VisionEncoder, heads: PatchHeads, pixels, cls_BP, colour_BP, quad_P) -> dict[str, float]:
    """Held-out accuracy on the patches a glyph stroke covers (glyph, colour) and on every patch (quadrant)."""
    glyph_BPC, colour_BPC, quad_BPC = heads(encoder(pixels))
    drawn_BP = cls_BP > 0
    return {"glyph": float((glyph_BPC.argmax(-1) == cls_BP)[drawn_BP].float().mean()),
            "colour": float((colour_BPC.argmax(-1) == colour_BP)[drawn_BP].float().mean()),
            "quadrant": float((quad_BPC.argmax(-1) == quad_P).float().mean())}


def pretrain(vision: VisionEncoderConfig, steps: int, batch: int = 64, lr: float = 1e-3, seed: int = 0,
             eval_scenes: int = 256, progress: bool = True) -> tuple[VisionEncoder, dict]:
    """Train a fresh tower of ``vision`` (its ``pretrained`` must be null) with AdamW, warmup + cosine LR; returns the
    tower and a summary (steps, final losses, held-out accuracy, seconds)."""
    from tqdm import tqdm
    from transformers import get_cosine_schedule_with_warmup

    if vision.pretrained is not None:
        raise ValueError(f"vision.pretrained must be null to pretrain a fresh tower (got {vision.pretrained!r})")
    torch.manual_seed(seed)
    encoder = build_vision_encoder(vision)
    heads = PatchHeads(encoder.embed_dim)
    quad_P = quadrant_ids(encoder.patch_grid)
    train, held_out = SceneBatches(encoder, "train", seed), SceneBatches(encoder, "test", seed + 1)
    eval_batch = held_out(eval_scenes)
    params = [*encoder.parameters(), *heads.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    sched = get_cosine_schedule_with_warmup(opt, max(1, steps // 20), max(1, steps))
    t0, bar = time.time(), tqdm(range(steps), desc="scene tower", disable=not progress, mininterval=2)
    encoder.train()
    for _ in bar:
        parts = losses(encoder, heads, *train(batch), quad_P)
        opt.zero_grad(set_to_none=True)
        sum(parts.values()).backward()
        opt.step()
        sched.step()
        bar.set_postfix({k: f"{v.detach():.3f}" for k, v in parts.items()}, refresh=False)
    encoder.eval()
    acc = accuracy(encoder, heads, *eval_batch, quad_P)
    summary = {"steps": steps, "batch": batch, "lr": lr, "seed": seed, "seconds": round(time.time() - t0, 1),
               "final_loss": {k: round(float(v.detach()), 4) for k, v in parts.items()} if steps else None,
               "held_out_accuracy": {k: round(v, 4) for k, v in acc.items()}, "held_out_scenes": eval_scenes}
    return encoder, summary


def save(encoder: VisionEncoder, out: Path, summary: dict) -> None:
    """The tower's own state dict (the keys ``vision.pretrained`` loads) as safetensors + ``<out>.json``."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in encoder.model.state_dict().items()}, str(out))
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")


def vision_section(preset: str) -> VisionEncoderConfig:
    """The model preset's ``vision`` section with ``pretrained`` cleared (this module makes those weights)."""
    raw = yaml.safe_load(Path(preset).read_text()) or {}
    if "vision" not in raw:
        raise ValueError(f"{preset}: no 'vision' section")
    return VisionEncoderConfig(**{**raw["vision"], "pretrained": None})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="configs/model/vlm_scene_tiny.yaml", help="model preset: its vision section")
    p.add_argument("--out", default="data/scenes/tower.safetensors")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        vision = vision_section(args.preset)
    except (OSError, ValueError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    encoder, summary = pretrain(vision, args.steps, args.batch, args.lr, args.seed)
    save(encoder, Path(args.out), summary)
    acc = summary["held_out_accuracy"]
    print(f"wrote {args.out} ({summary['steps']} steps, {summary['seconds']} s): held-out patches right: "
          f"glyph {acc['glyph']:.1%}, colour {acc['colour']:.1%}, quadrant {acc['quadrant']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
