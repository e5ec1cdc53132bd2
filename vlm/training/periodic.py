"""In-training hooks: a boundary picture every ``log.visualize_every`` steps and a held-out VQA score
every ``eval.every_steps`` steps (both on rank 0 with the live weights)."""
from __future__ import annotations

import json
import os
import time

import numpy as np
import torch

from vlm.training.distributed import barrier


def boundary_picture(tr) -> None:
    """Optional hook: a boundary picture via ``vlm.visualize.render_boundaries`` on the first
    eval.vqa_json question, saved to <run>/boundaries/ and TensorBoard. Skipped silently when
    ``vlm.visualize`` is missing, and skipped for ZeRO-3 (rank 0 holds only a shard)."""
    if not tr.is_main or tr.processor is None or tr.zero_stage == 3 or not tr.cfg.eval.vqa_json:
        return
    try:
        from vlm.visualize import render_boundaries
    except ImportError:
        return
    try:
        from data_pipelines.images import load_image

        with open(tr.cfg.eval.vqa_json, encoding="utf-8") as f:
            rec = json.load(f)[0]
        image = load_image(os.path.join(tr.cfg.eval.image_root or "", rec["image"]))
        prompt = rec["conversations"][0]["value"]
        picture = render_boundaries(tr.engine.module, tr.processor, [image], prompt)
        path = tr.run_dir / "boundaries" / f"step_{tr.step:06d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        picture.save(path)
        if tr.logger.tb is not None:
            arr = torch.from_numpy(np.array(picture.convert("RGB"))).permute(2, 0, 1)
            tr.logger.tb.add_image("boundaries", arr, tr.step)
    except Exception as err:  # noqa: BLE001 - an optional picture must never stop training
        tr.print(f"[train] boundary picture skipped: {type(err).__name__}: {err}")


def periodic_vqa(tr) -> None:
    """Held-out VQA on the live weights (rank 0; ZeRO-1/2 keep full weights on every rank)."""
    e = tr.cfg.eval
    if tr.zero_stage < 3 and tr.is_main and e.vqa_json and tr.processor is not None:
        from vlm.training.vqa_eval import digits_vqa_accuracy

        t0 = time.perf_counter()
        res = digits_vqa_accuracy(tr.engine.module, tr.processor, e.vqa_json, e.image_root or "",
                                  e.periodic_limit, batch_size=e.batch_size, max_new_tokens=e.max_new_tokens)
        rec = {"step": tr.step, "eval_vqa_accuracy": res["accuracy"],
               **{f"eval_vqa_{k}": v for k, v in res["by_kind"].items()},
               **{f"eval_{k}": res[k] for k in ("ratio", "ratio_image", "ratio_text") if k in res},
               "eval_time_s": time.perf_counter() - t0}
        tr.logger.log(rec)
        tr.print(f"[train] step {tr.step}: held-out VQA {res['accuracy']:.1%} on {res['total']} questions")
    barrier()
