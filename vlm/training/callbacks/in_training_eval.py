"""In-training callbacks run on rank 0 with the current weights: a boundary picture every
``log.visualize_every`` steps (``BoundaryPictures``) and a held-out VQA score every ``eval.every_steps``
steps but the last (``PeriodicEval``). Under expert parallelism rank 0 runs an unsharded copy of the
gathered weights (``gathered.scoring_model``)."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from vlm.training.callbacks.base import Callback, StepEnd
from vlm.training.distributed import barrier
from vlm.training.gathered import scoring_model
from vlm.training.state import RunContext


def boundary_picture(ctx: RunContext, step: int, tb: Any | None = None) -> None:
    """A picture of the chunk boundaries (``vlm.visualize.render_boundaries``) on the first
    ``eval.vqa_json`` question, saved to <run>/boundaries/ and to the TensorBoard writer ``tb``.
    Collective under expert parallelism (the weights are gathered). Skipped silently when
    ``vlm.visualize`` is missing, and for ZeRO-3 (rank 0 holds only a shard)."""
    e = ctx.cfg.eval
    if ctx.processor is None or ctx.zero_stage == 3 or not e.vqa_json:  # the same on every rank
        return
    try:
        from vlm.visualize import render_boundaries
    except ImportError:
        return
    model = scoring_model(ctx)
    if model is None:  # not rank 0
        return
    try:
        from vlm.modeling.image_transform import load_image

        with open(e.vqa_json, encoding="utf-8") as f:
            rec = json.load(f)[0]
        image = load_image(os.path.join(e.image_root or "", rec["image"]))
        prompt = rec["conversations"][0]["value"]
        picture = render_boundaries(model, ctx.processor, [image], prompt)
        path = ctx.run_dir / "boundaries" / f"step_{step:06d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        picture.save(path)
        if tb is not None:
            arr = torch.from_numpy(np.array(picture.convert("RGB"))).permute(2, 0, 1)
            tb.add_image("boundaries", arr, step)
    except Exception as err:  # noqa: BLE001 - an optional picture must never stop training
        ctx.log_line(f"[train] boundary picture skipped: {type(err).__name__}: {err}")


def periodic_vqa(ctx: RunContext, step: int, log: Callable[[dict], None]) -> None:
    """Collective (a barrier): held-out VQA on the current weights, scored on rank 0 (ZeRO-1/2 keep
    full weights on every rank, expert parallelism gathers them; skipped on ZeRO-3); the record goes
    to ``log``."""
    e = ctx.cfg.eval
    model = None
    if ctx.zero_stage < 3 and e.vqa_json and ctx.processor is not None:  # the same on every rank
        model = scoring_model(ctx)
    if model is not None:
        from eval_suites.digits_vqa import digits_vqa_accuracy

        t0 = time.perf_counter()
        res = digits_vqa_accuracy(model, ctx.processor, e.vqa_json, e.image_root or "",
                                  e.periodic_limit, batch_size=e.batch_size, max_new_tokens=e.max_new_tokens,
                                  breakdown_by=e.breakdown_by)
        log({"step": step, "eval_vqa_accuracy": res["accuracy"],
             **{f"eval_vqa_{k}": v for k, v in res["by_kind"].items()},
             **{f"eval_{k}": res[k] for k in ("ratio", "ratio_image", "ratio_text") if k in res},
             "eval_time_s": time.perf_counter() - t0})
        ctx.log_line(f"[train] step {step}: held-out VQA {res['accuracy']:.1%} on {res['total']} questions")
    barrier()


class BoundaryPictures(Callback):
    def on_step_end(self, trainer, step: StepEnd) -> None:
        every = trainer.cfg.log.visualize_every
        if every and step.step % every == 0:
            boundary_picture(trainer.ctx, step.step, trainer.logger.tb)


class PeriodicEval(Callback):
    def on_step_end(self, trainer, step: StepEnd) -> None:
        every = trainer.cfg.eval.every_steps
        if every and step.step % every == 0 and not step.last:
            periodic_vqa(trainer.ctx, step.step, trainer.logger.log)
