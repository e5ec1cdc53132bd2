"""Measurements of the VLM study on the trained arms' exports: prefill time per sample (every arm on
the same held-out prompts, interleaved rep by rep so that load on the machine hits all arms alike),
which patches the chunker merged (boundary rate on glyph vs background patches) and its pictures."""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from data_pipelines.scene_data import glyph_cells


def image_records(vqa_json: str, n: int) -> list[dict]:
    """The first ``n`` held-out records that carry an image (file order)."""
    records = json.loads(Path(vqa_json).read_text())
    return [r for r in records if r.get("image")][:n]


def load_export(hf: str):
    """(model in eval mode, processor) of an HF export of the VLM."""
    from vlm.modeling.modeling_conceptmoe_vl import (
        ConceptMoEVLMForConditionalGeneration,
    )
    from vlm.modeling.processing_conceptmoe_vl import ConceptMoEVLMProcessor

    model = ConceptMoEVLMForConditionalGeneration.from_pretrained(hf).eval()
    return model, ConceptMoEVLMProcessor.from_pretrained(hf)


def _batch(processor, records: list[dict], image_root: str):
    from PIL import Image

    prompts = [r["conversations"][0]["value"] for r in records]
    images = [Image.open(os.path.join(image_root, r["image"])).convert("RGB") for r in records]
    return processor(text=prompts, images=images, padding_side="left"), images


@torch.no_grad()
def probe(arms: dict[str, str], vqa_json: str, image_root: str, batch: int, reps: int, pictures: int,
          picture_dir: Path) -> dict:
    """``arms``: arm id -> HF export folder. Returns {arm id: {prefill_ms_per_sample, boundary stats}}
    and writes ``picture_dir/<arm>_<i>.png`` for the chunking arms."""
    from vlm.visualize import render_boundaries

    records = image_records(vqa_json, batch)
    loaded = {a: load_export(hf) for a, hf in arms.items()}
    inputs = {}
    for a, (model, processor) in loaded.items():
        enc, images = _batch(processor, records, image_root)
        inputs[a] = (enc, images)
        model(input_ids=enc["input_ids"], pixel_values=enc["pixel_values"], attention_mask=enc["attention_mask"])
    times: dict[str, list[float]] = {a: [] for a in loaded}
    for _ in range(reps):
        for a, (model, _) in loaded.items():  # interleaved: the arms share the machine's state
            enc = inputs[a][0]
            t0 = time.perf_counter()
            model(input_ids=enc["input_ids"], pixel_values=enc["pixel_values"], attention_mask=enc["attention_mask"])
            times[a].append(time.perf_counter() - t0)
    out = {}
    picture_dir.mkdir(parents=True, exist_ok=True)
    for a, (model, processor) in loaded.items():
        res = {"prefill_ms_per_sample": 1000 * statistics.median(times[a]) / len(records),
               "prefill_samples": len(records), "prefill_reps": reps}
        enc, images = inputs[a]
        o = model(input_ids=enc["input_ids"], pixel_values=enc["pixel_values"], attention_mask=enc["attention_mask"])
        if o.boundary_mask is not None:
            res.update(_boundary_stats(model, enc, o.boundary_mask, records))
            res["pictures"] = []
            for i, (rec, img) in enumerate(zip(records[:pictures], images)):
                path = picture_dir / f"{a}_{i}.png"
                render_boundaries(model, processor, [img], rec["conversations"][0]["value"]).save(path)
                res["pictures"].append({"file": path.name, "clutter": rec.get("clutter"),
                                        "glyph_size": rec.get("glyph_size")})
        out[a] = res
    return out


def _boundary_stats(model, enc, boundary_BT, records) -> dict:
    """Boundary rate (new concept starts) on image tokens over glyph cells vs background cells."""
    grid = model.projector.output_grid
    image_BT = enc["input_ids"] == model.config.image_token_id
    hits = {"glyph": [0, 0], "background": [0, 0]}
    for b, rec in enumerate(records):
        pos = image_BT[b].nonzero().flatten()  # a report-time probe on the host, not a training step
        cells = glyph_cells(rec["scene"], grid, model.vision.image_size)
        bnd = boundary_BT[b, pos].bool().tolist()
        for is_glyph, flag in zip(cells.tolist(), bnd):
            key = "glyph" if is_glyph else "background"
            hits[key][0] += int(flag)
            hits[key][1] += 1
    return {f"boundary_rate_{k}": (v[0] / v[1] if v[1] else None) for k, v in hits.items()} | {
        "glyph_cells": hits["glyph"][1], "background_cells": hits["background"][1]}
