"""The trainer's callback protocol, as OLMo-core's and torchtitan's trainers have one: ``Trainer.fit``
runs ``train_step`` and calls these hooks, in the order of ``Trainer.callbacks``, at fixed points.
Every hook is collective: every rank calls it at the same point (rank-0-only work checks
``trainer.is_main``). ``defaults.py`` lists what a training run uses."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Trainer = Any  # vlm.training.trainer.Trainer (not imported: the trainer imports its callbacks)


@dataclass(frozen=True)
class StepEnd:
    """What ``Trainer.train_step`` did: optimizer step ``step`` (``Progress.step`` after it) was
    taken, or skipped by DeepSpeed (non-finite loss or gradient); ``last``: ``step`` is the stop step."""

    step: int
    skipped: bool
    last: bool


class Callback:
    """Hooks of one training run; each does nothing unless overridden."""

    def on_fit_start(self, trainer: Trainer) -> None:
        """``fit`` starts (at ``trainer.step``: 0, or the resumed step)."""

    def on_step_start(self, trainer: Trainer) -> None:
        """Before optimizer step ``trainer.step + 1`` reads its first micro-batch."""

    def on_micro_batch(self, trainer: Trainer, out: Any, batch: dict) -> None:
        """After the forward of one micro-batch, before its backward; ``out.loss`` may be replaced."""

    def on_step_end(self, trainer: Trainer, step: StepEnd) -> None:
        """After each optimizer step (the accumulation boundary)."""

    def on_fit_end(self, trainer: Trainer, exhausted: bool) -> None:
        """The loop ended at the stop step, or early because the data ran out (``exhausted``); not
        called when it raised."""

    def on_train_end(self, trainer: Trainer) -> dict | None:
        """After ``fit`` (``Trainer.finish``): what the run leaves behind; a returned dict is merged
        into ``finish``'s result."""
        return None

    def close(self) -> None:
        """Release what the callback holds (``Trainer.close``)."""

