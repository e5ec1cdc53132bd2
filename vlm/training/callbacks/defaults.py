"""``default_callbacks``: a training run's callbacks, in the order they run."""
from __future__ import annotations

from vlm.training.callbacks.base import Callback
from vlm.training.callbacks.checkpoint_interval import CheckpointInterval
from vlm.training.callbacks.end_of_run import EndOfRun
from vlm.training.callbacks.in_training_eval import BoundaryPictures, PeriodicEval
from vlm.training.callbacks.log_window import LogWindow
from vlm.training.callbacks.nonfinite_guard import NonFiniteGuard


def default_callbacks() -> list[Callback]:
    """A training run's callbacks, in the order they run: the logging window first (a skipped step is
    logged before the non-finite guard may abort), the guard before anything that writes (no
    checkpoint after an abort), the checkpoint interval after the in-training evals of the same step."""
    return [LogWindow(), NonFiniteGuard(), BoundaryPictures(), PeriodicEval(), CheckpointInterval(), EndOfRun()]
