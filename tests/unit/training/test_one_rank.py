"""One rank (vlm/training/one_rank.py, build_ds_config): ZeRO-2 without contiguous gradient buckets and without
its identity "reduction" trains bit for bit as DeepSpeed's own path does, and launches no per-parameter copy."""
from __future__ import annotations

import pytest
import torch

from _train_helpers import config, fit_inprocess


def _weights(precision: str, tmp_path, fast: bool, monkeypatch) -> tuple[dict, bool]:
    from vlm.config.train import load_train_config
    from vlm.training import trainer as trainer_mod

    if not fast:  # DeepSpeed's own path: contiguous buckets, the bucket flattened, "all-reduced", copied back
        monkeypatch.setattr(trainer_mod, "skip_single_rank_reduction", lambda optimizer: False)
    raw = config(tmp_path / f"{precision}_{fast}", name=f"one_rank_{precision}_{fast}", precision=precision,
                 train={"max_steps": 3, "grad_accum": 2}, checkpoint={"every_steps": 0, "save_final": False},
                 **({} if fast else {"deepspeed_overrides": {"zero_optimization": {"contiguous_gradients": True}}}))
    trainer = fit_inprocess(load_train_config(raw=raw))
    monkeypatch.undo()
    state = {k: v.detach().float().clone() for k, v in trainer.engine.module.state_dict().items()}
    return state, trainer.single_rank_reduction_skipped


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_rank_path_trains_bit_for_bit_as_deepspeeds(tmp_path, monkeypatch, precision):
    ref, skipped_ref = _weights(precision, tmp_path, False, monkeypatch)
    fast, skipped = _weights(precision, tmp_path, True, monkeypatch)
    assert (skipped_ref, skipped) == (False, True)
    assert ref.keys() == fast.keys()
    moved = [k for k in ref if not torch.equal(ref[k], fast[k])]
    assert moved == [], moved[:5]


def test_backward_launches_no_per_parameter_copy(tmp_path):
    from benchmarks.overhead import OursStep, count_step

    step = OursStep(False, 128, 1, tmp_path, torch.device("cpu"), torch.float32, {"num_hidden_layers": 3})
    try:
        oc = count_step(step, "moe")
    finally:
        step.close()
    zero_backward = [(op, where) for phase, _, op, where in oc.ops
                     if phase == "backward" and "deepspeed/runtime/zero/stage_1_and_2.py" in where]
    assert zero_backward == [], zero_backward[:4]  # DeepSpeed's loss scaling runs, nothing of ZeRO's buckets
