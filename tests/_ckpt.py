"""A stand-in for DeepSpeed's engine in checkpoint tests (tests/unit/training/test_checkpoint.py,
tests/unit/training/test_safe_loading.py): ``checkpoint.save`` / ``load`` run for real, the engine files are fakes."""
from __future__ import annotations

from pathlib import Path

from vlm.training import checkpoint as ckpt


class FakeEngine:
    """Writes what DeepSpeed's save_checkpoint would, into save_dir/tag; load opens nothing."""

    def __init__(self):
        self.loaded = None

    def save_checkpoint(self, save_dir, tag, client_state=None, save_latest=True):
        d = Path(save_dir) / tag
        d.mkdir(parents=True, exist_ok=True)
        (d / "mp_rank_00_model_states.pt").write_bytes(b"weights")
        assert not save_latest  # the pointer is ours, written atomically after the rename

    def load_checkpoint(self, load_dir, tag, **kwargs):
        self.loaded = Path(load_dir) / tag
        return str(self.loaded), {}


def save(engine, d, step, keep=2) -> Path:
    """One complete single-rank checkpoint of ``step`` in ``d`` through ``checkpoint.save``."""
    return ckpt.save(engine, d, step, {"skipped_steps": 0}, {"rng": ckpt.rng_state(), "data": {"index": step}},
                     keep_last=keep)
