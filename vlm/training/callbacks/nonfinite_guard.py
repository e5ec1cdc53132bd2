"""``train.max_nonfinite_in_row`` skipped steps in a row abort the run (``NonFiniteAbort``, exit code 3)
before any further checkpoint is written, so the last good checkpoint stays the newest one."""
from __future__ import annotations

from vlm.training import checkpoint as ckpt
from vlm.training.callbacks.base import Callback, StepEnd


class NonFiniteAbort(RuntimeError):
    """Too many non-finite steps in a row."""


class NonFiniteGuard(Callback):
    def on_step_end(self, trainer, step: StepEnd) -> None:
        p, cfg = trainer.progress, trainer.cfg
        if p.nonfinite_in_row >= cfg.train.max_nonfinite_in_row:
            msg = (f"aborting: {p.nonfinite_in_row} non-finite steps in a row (train.max_nonfinite_in_row="
                   f"{cfg.train.max_nonfinite_in_row}) at step {p.step}; the last good checkpoint is "
                   f"{ckpt.find_checkpoint(cfg.ckpt_dir) or 'none'} (left untouched)")
            trainer.log_line(f"[train] {msg}")
            raise NonFiniteAbort(msg)
