"""``default_callbacks``: a training run's callbacks, in the order they run."""
from __future__ import annotations

from vlm.training.callbacks.base import Callback
from vlm.training.callbacks.checkpoint_interval import CheckpointInterval
from vlm.training.callbacks.end_of_run import EndOfRun
from vlm.training.callbacks.in_training_eval import BoundaryPictures, PeriodicEval
from vlm.training.callbacks.log_window import LogWindow
from vlm.training.callbacks.nonfinite_guard import NonFiniteGuard
from vlm.training.callbacks.profile_window import ProfileWindow


def default_callbacks() -> list[Callback]:
    """A training run's callbacks, in the order they run: the profiler window first (a no-op unless
    ``log.profile_steps`` is set: it closes before the other hooks of its last step run, so its window holds
    training steps only), the logging window (a skipped step is logged before the non-finite guard may
    abort), the guard before anything that writes (no checkpoint after an abort), the checkpoint interval
    after the in-training evals of the same step."""
    return [ProfileWindow(), LogWindow(), NonFiniteGuard(), BoundaryPictures(), PeriodicEval(), CheckpointInterval(),
            EndOfRun()]
