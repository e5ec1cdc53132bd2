"""The logging window: per-micro-batch sums (``WindowStats``), and every ``log.every_steps`` steps (and
at every skipped step and the stop step) one record reduced over the ranks: losses, achieved ratios,
throughput, MFU, learning rates, grad norm, skip counters (keys: ``metrics.MetricsLogger``)."""
from __future__ import annotations

import time

import torch

from vlm.training.callbacks.base import Callback, StepEnd
from vlm.training.metrics import (
    WindowStats,
    process_health,
    summarize,
    train_flops_per_token,
)


class LogWindow(Callback):
    """Owns the window; its elapsed time (from one record to the next) is the training time the
    record's throughput and ``Progress.train_time_s`` count."""

    def __init__(self):
        self.window: WindowStats | None = None
        self.t0 = 0.0

    def on_fit_start(self, trainer) -> None:
        self.window = WindowStats(trainer.image_token_id)
        self.t0 = time.perf_counter()

    def on_micro_batch(self, trainer, out, batch: dict) -> None:
        self.window.add(out, batch)

    def on_step_end(self, trainer, step: StepEnd) -> None:
        if step.step % trainer.cfg.log.every_steps == 0 or step.last or step.skipped:
            self._log(trainer)

    def on_fit_end(self, trainer, exhausted: bool) -> None:
        if self.window.micro and not exhausted:  # steps since the last record
            self._log(trainer)

    def _log(self, trainer) -> None:
        """Collective: one record for the window, then a fresh window."""
        p = trainer.progress
        elapsed = time.perf_counter() - self.t0
        red = self.window.reduce()  # collective
        skipped_samples = _skipped_samples(trainer.loader, trainer.world_size)  # collective
        rec = {"step": p.step, **summarize(red, elapsed, trainer.world_size)}
        p.tokens_seen += rec["tokens"]
        engine = trainer.engine
        lrs = engine.get_lr()
        rec["lr"] = float(lrs[0]) if lrs else None
        rec["lr_groups"] = {n: float(lr) for n, lr in zip(trainer.group_names, lrs)}
        gn = engine.get_global_grad_norm()
        rec["grad_norm"] = float(gn) if gn is not None else None
        rec["skipped_steps"] = p.skipped_steps
        rec["nonfinite_in_row"] = p.nonfinite_in_row
        rec["skipped_samples"] = skipped_samples
        rec["tokens_seen"] = p.tokens_seen
        fpt = train_flops_per_token(trainer.text_config, rec["mean_doc_len"], rec.get("ratio"), trains=trainer.trains)
        if fpt is not None:
            rec["flops_per_token"] = fpt
            rec.update(trainer.mfu(rec["tokens_per_s"] * fpt, p.step))
        rec["time_s"] = round(time.time() - trainer.t_start, 3)
        rec.update(process_health())
        p.last_record = rec
        trainer.logger.log(rec)
        p.train_time_s += elapsed
        self.window.reset()
        self.t0 = time.perf_counter()


def _skipped_samples(loader, world_size: int) -> dict:
    """Collective: the loader's bad-record counts by reason, summed over the ranks (loaders that drop
    bad samples count them in ``bad_counts``)."""
    local = dict(getattr(loader, "bad_counts", None) or {})
    if world_size > 1:
        gathered = [None] * world_size
        torch.distributed.all_gather_object(gathered, local)
    else:
        gathered = [local]
    total: dict = {}
    for d in gathered:
        for k, v in (d or {}).items():
            total[k] = total.get(k, 0) + int(v)
    return total
