"""Does a VLM read its image? Two measures on held-out image records, on any ConceptMoE-VL model:
the spread of the image tokens the language model receives (vision tower + projector output; ~0 when
it collapsed to one vector) and how much the answer's next-token distribution moves when the record's
image is swapped for another record's (same question text; ~0 when the model answers from the question
alone). Prompts are built as the held-out eval builds them (eval_suites.digits_vqa).

    python -m vlm.compare.image_use --model runs/x/hf --data data/scenes/scenes_test.json \
        --image-root data/scenes/images -n 64
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from vlm.compare.vlm_probe import image_records, load_export


def swap_partners(records: list[dict]) -> list[int]:
    """For record i, the index of the next record (cyclically) whose image file differs: its image
    replaces record i's in the swapped forward. One clear error when every record shows the same file."""
    names = [r["image"] for r in records]
    out = []
    for i, name in enumerate(names):
        j = next((k % len(names) for k in range(i + 1, i + len(names)) if names[k % len(names)] != name), None)
        if j is None:
            raise ValueError(f"image_use: the {len(names)} record(s) show one image file ({name!r}); "
                             "need two different images to swap")
        out.append(j)
    return out


def _mean_pair_l1(x_GND: torch.Tensor) -> torch.Tensor:
    """Float[G]: per group, the mean over ordered pairs i != j of mean_d |x_i - x_j| (N >= 2 rows)."""
    n, d = x_GND.shape[1], x_GND.shape[2]
    dist_GNN = torch.cdist(x_GND, x_GND, p=1) / d  # diagonal is 0
    return dist_GNN.sum(dim=(1, 2)) / (n * (n - 1))


def token_spread(feats_NQD: torch.Tensor) -> dict:
    """Spread of the image tokens fed to the LM, scale-free (divided by their mean |x|).

    ``patch_spread``: mean over images of the mean |x_i - x_j| over token pairs of one image.
    ``image_spread``: mean over token slots of the mean |x_a - x_b| over image pairs at that slot.
    ``patch_std``: mean over images and dims of the std across an image's tokens, same scale.
    """
    x_NQD = feats_NQD.float()
    scale = x_NQD.abs().mean()
    n, q = x_NQD.shape[:2]
    out = {"token_abs_mean": float(scale), "images": n, "tokens_per_image": q}
    out["patch_spread"] = float(_mean_pair_l1(x_NQD).mean() / scale) if q > 1 else None
    out["image_spread"] = float(_mean_pair_l1(x_NQD.transpose(0, 1)).mean() / scale) if n > 1 else None
    out["patch_std"] = float(x_NQD.std(dim=1).mean() / scale) if q > 1 else None
    return out


def answer_shift(logits_own_BV: torch.Tensor, logits_swap_BV: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per record: total-variation distance between the answer-position next-token distributions with
    the own vs the other image, whether the greedy first answer token changes, max |logit change|."""
    p_BV, q_BV = logits_own_BV.float().softmax(-1), logits_swap_BV.float().softmax(-1)
    return {"tv": 0.5 * (p_BV - q_BV).abs().sum(-1),
            "flip": (logits_own_BV.argmax(-1) != logits_swap_BV.argmax(-1)).float(),
            "max_logit_change": (logits_own_BV.float() - logits_swap_BV.float()).abs().amax(-1)}


def _load_images(records: list[dict], image_root: str) -> list:
    from vlm.modeling.image_transform import load_image

    images = []
    for rec in records:
        img = load_image(os.path.join(image_root, rec["image"]))
        if not hasattr(img, "size"):  # a Skip: missing / corrupt image
            raise FileNotFoundError(f"{rec['image']}: {getattr(img, 'reason', img)}")
        images.append(img)
    return images


@torch.no_grad()
def image_use(model, processor, records: list[dict], image_root: str, batch_size: int = 64) -> dict:
    """The two measures on ``records`` (image records; prompts as the eval builds them: the user turn,
    the processor's chat format, left padding; the answer position is the last one). Returns
    ``{records, patch_spread, image_spread, patch_std, token_abs_mean, tv, flip_rate, max_logit_change}``.
    Views: one per picture expected (a picture cut into several anyres views is refused)."""
    from eval_suites.digits_vqa import _question_answer

    if len(records) < 2:
        raise ValueError(f"image_use: needs at least 2 image records, got {len(records)}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    partner = swap_partners(records)
    images = _load_images(records, image_root)
    questions = [_question_answer(r)[0] for r in records]
    feats, shifts = [], {"tv": [], "flip": [], "max_logit_change": []}
    try:
        for start in range(0, len(records), batch_size):
            idx = range(start, min(start + batch_size, len(records)))
            own = processor(text=[questions[i] for i in idx], images=[images[i] for i in idx], padding_side="left")
            swap = processor(text=[questions[i] for i in idx], images=[images[partner[i]] for i in idx],
                             padding_side="left")
            if own["pixel_values"].shape[0] != len(idx):
                raise ValueError("image_use: one view per picture expected (image_aspect 'anyres' is not supported)")
            ids, mask = own["input_ids"].to(device), own["attention_mask"].to(device)
            pix_own, pix_swap = own["pixel_values"].to(device), swap["pixel_values"].to(device)
            vision_dtype = next(model.vision.parameters()).dtype
            feats.append(model.projector(model.vision(pix_own.to(vision_dtype))).float().cpu())
            last_own_BV = model(input_ids=ids, pixel_values=pix_own, attention_mask=mask).logits[:, -1]
            last_swap_BV = model(input_ids=ids, pixel_values=pix_swap, attention_mask=mask).logits[:, -1]
            for k, v in answer_shift(last_own_BV, last_swap_BV).items():
                shifts[k].append(v.cpu())
    finally:
        model.train(was_training)
    out = {"records": len(records)} | token_spread(torch.cat(feats))
    out["tv"] = float(torch.cat(shifts["tv"]).mean())
    out["flip_rate"] = float(torch.cat(shifts["flip"]).mean())
    out["max_logit_change"] = float(torch.cat(shifts["max_logit_change"]).mean())
    return out


def measure_export(hf: str, vqa_json: str, image_root: str, n: int, batch_size: int = 64) -> dict:
    """``image_use`` of an HF export on the first ``n`` image records of ``vqa_json``."""
    model, processor = load_export(hf)
    return image_use(model, processor, image_records(vqa_json, n), image_root, batch_size)


def measure_runs(results: list[dict], vqa_json: str, image_root: str, n: int) -> dict:
    """{arm: {seed (str): image_use}} over the compare runs' exports (``<run_dir>/hf``), all on the same
    first ``n`` image records; a run whose export is gone gets ``{"missing": <path>}``."""
    out: dict = {}
    for r in results:
        hf = Path(r["run_dir"]) / "hf"
        res = measure_export(str(hf), vqa_json, image_root, n) if (hf / "config.json").is_file() else {
            "missing": str(hf)}
        out.setdefault(r["arm"], {})[str(r["seed"])] = res
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vlm.compare.image_use", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF export folder")
    p.add_argument("--data", required=True, help="LLaVA JSON split (held-out records)")
    p.add_argument("--image-root", required=True)
    p.add_argument("-n", type=int, default=64, help="image records (the first n with an image)")
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args(argv)
    print(json.dumps(measure_export(args.model, args.data, args.image_root, args.n, args.batch_size), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
