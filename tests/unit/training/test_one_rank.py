"""One rank (vlm/training/one_rank.py, build_ds_config): ZeRO-2 without contiguous gradient buckets and without
its identity "reduction" trains bit for bit as DeepSpeed's own path does, and launches no per-parameter copy."""
from __future__ import annotations

import pytest
import torch

from _train_helpers import config, fit_inprocess


PRECISIONS = {"fp32": ("fp32", {}), "bf16": ("bf16", {}),
              # bf16 weights, fp32 gradient accumulation: ZeRO-2 keeps fp32 gradient partitions; with contiguous
              # buckets (asked for) the reduction fills them through allreduce_and_copy's output_bucket
              "bf16-fp32-grads": ("bf16", {"data_types": {"grad_accum_dtype": "fp32"}}),
              "bf16-fp32-grads-contiguous": ("bf16", {"data_types": {"grad_accum_dtype": "fp32"},
                                                      "zero_optimization": {"contiguous_gradients": True}})}


def _weights(case: str, tmp_path, fast: bool, monkeypatch) -> tuple[dict, bool]:
    from vlm.config.train import load_train_config
    from vlm.training import trainer as trainer_mod

    precision, overrides = PRECISIONS[case]
    if not fast:  # DeepSpeed's own path: contiguous buckets, the bucket flattened, "all-reduced", copied back
        monkeypatch.setattr(trainer_mod, "skip_single_rank_reduction", lambda optimizer: False)
        overrides = {**overrides, "zero_optimization": {"contiguous_gradients": True}}
    raw = config(tmp_path / f"{case}_{fast}", name=f"one_rank_{case}_{fast}", precision=precision,
                 train={"max_steps": 3, "grad_accum": 2}, checkpoint={"every_steps": 0, "save_final": False},
                 deepspeed_overrides=overrides)
    trainer = fit_inprocess(load_train_config(raw=raw))
    monkeypatch.undo()
    state = {k: v.detach().float().clone() for k, v in trainer.engine.module.state_dict().items()}
    return state, trainer.single_rank_reduction_skipped


@pytest.mark.parametrize("case", list(PRECISIONS))
def test_one_rank_path_trains_bit_for_bit_as_deepspeeds(tmp_path, monkeypatch, case):
    ref, skipped_ref = _weights(case, tmp_path, False, monkeypatch)
    fast, skipped = _weights(case, tmp_path, True, monkeypatch)
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


def test_reduction_into_partition_buffers_is_deepspeeds(tmp_path):
    """The installed skip on a bucket whose gradients also go to fp32 partition buffers (``output_bucket``, bf16
    with fp32 gradient accumulation): DeepSpeed's own call runs, the buffers get the gradients."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Zero

    from vlm.config.train import load_train_config

    raw = config(tmp_path, name="one_rank_outputs", precision="bf16", train={"max_steps": 1},
                 checkpoint={"every_steps": 0, "save_final": False},
                 deepspeed_overrides={"data_types": {"grad_accum_dtype": "fp32"}})
    trainer = fit_inprocess(load_train_config(raw=raw))
    opt = trainer.engine.optimizer
    assert trainer.single_rank_reduction_skipped
    grads = [torch.linspace(-1, 1, 6, dtype=torch.bfloat16), torch.linspace(2, 3, 4, dtype=torch.bfloat16)]
    ours, ds = [g.clone() for g in grads], [g.clone() for g in grads]
    out_ours, out_ds = [torch.ones(g.numel()) for g in grads], [torch.ones(g.numel()) for g in grads]
    opt.allreduce_and_copy(ours, torch.bfloat16, output_bucket=out_ours)
    Zero.allreduce_and_copy(opt, ds, torch.bfloat16, output_bucket=out_ds)
    assert all(torch.equal(a, b) for a, b in zip(ours + out_ours, ds + out_ds))
    assert not torch.equal(out_ds[0], torch.ones(6))  # the buffers did get the gradients
    opt.allreduce_and_copy(ours, torch.bfloat16)  # no buffers: the identity, skipped
    assert all(torch.equal(a, b) for a, b in zip(ours, ds))
