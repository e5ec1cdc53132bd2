"""Checkpoints during training: every ``checkpoint.every_steps`` steps (not at the stop step), and at
the end of ``fit`` with ``checkpoint.save_final`` unless that step is saved already."""
from __future__ import annotations

from vlm.training.callbacks.base import Callback, StepEnd


class CheckpointInterval(Callback):
    def on_step_end(self, trainer, step: StepEnd) -> None:
        every = trainer.cfg.checkpoint.every_steps
        if every and step.step % every == 0 and not step.last:
            trainer.save_checkpoint()

    def on_fit_end(self, trainer, exhausted: bool) -> None:
        if trainer.cfg.checkpoint.save_final and trainer.last_saved_step != trainer.step:
            trainer.save_checkpoint()
