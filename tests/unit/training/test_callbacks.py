"""The trainer's default callbacks: their order (``callbacks/defaults.py``), and what it guarantees: a
run that aborts on non-finite steps never writes a checkpoint at the aborting step, even when that step
is a checkpoint step."""
from __future__ import annotations

import _train_helpers as helpers
import pytest

from vlm.training import checkpoint as ckpt
from vlm.training.callbacks.defaults import default_callbacks


def test_default_order():
    """The profiler window first (it closes before the other hooks of its last step), the logging window
    (a skipped step is logged before the guard may abort), the non-finite guard before anything that
    writes, the checkpoint after the in-training evals, the end of run last."""
    assert [type(cb).__name__ for cb in default_callbacks()] == [
        "ProfileWindow", "LogWindow", "NonFiniteGuard", "BoundaryPictures", "PeriodicEval", "CheckpointInterval",
        "EndOfRun"]


def test_an_aborting_nonfinite_step_on_a_checkpoint_step_is_not_saved(tmp_path):
    """Checkpoints every step, abort at the first non-finite step (step 2, a checkpoint step): step 1's
    checkpoint stays the newest, and nothing of step 2 is on disk."""
    from vlm.reliability.faults import ENV, Faults
    from vlm.training.callbacks.nonfinite_guard import NonFiniteAbort

    raw = helpers.config(tmp_path, name="abort", train={"max_steps": 3, "max_nonfinite_in_row": 1},
                         checkpoint={"every_steps": 1, "keep_last": 5})
    with pytest.raises(NonFiniteAbort, match="1 non-finite steps in a row .* at step 2"):
        helpers.run_inprocess(raw, tmp_path, faults=Faults.from_env({ENV: "nan:loss:2"}))
    ck = tmp_path / "abort" / "ckpt"
    assert [p.name for p in ckpt.list_checkpoints(ck)] == ["step_000001"]
    assert not any(p.name.startswith("step_000002") for p in ck.iterdir())
    assert ckpt.find_checkpoint(ck).name == "step_000001"
