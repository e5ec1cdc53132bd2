"""The ZeRO-1/2 step's norm (vlm/training/zero_norm.py): one foreach norm per group, one named host read, the
clip factor from it. Checked against DeepSpeed's own code on the same gradients, and on the trainer's whole
step with the op counter (no unnamed read: DeepSpeed's ``bool()`` on the norm tensor is gone)."""
from __future__ import annotations

import math

import pytest
import torch

from _train_helpers import config, fit_inprocess
from vlm.training.callbacks.base import Callback
from vlm.training.zero_norm import NORM_READ, combined_scale, group_norm


class Grads(Callback):
    """At the first micro-batch, after backward: each group's norm by DeepSpeed's code and by ours."""

    def __init__(self):
        self.pairs: list[tuple[float, float]] = []

    def on_micro_batch(self, trainer, out, batch) -> None:
        if trainer.step == 0:
            opt = trainer.engine.optimizer
            trainer.engine.backward(out.loss)
            from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
            for i, _ in enumerate(opt.bit16_groups):
                grads, params = opt.averaged_gradients[i], opt.params_in_partition[i]
                ds = DeepSpeedZeroOptimizer.get_grad_norm_direct(opt, grads, params)
                self.pairs.append((float(ds), float(group_norm(opt, grads, params))))
            raise StopTraining


class StopTraining(Exception):
    pass


def test_group_norm_equals_deepspeeds_per_parameter_norm(tmp_path):
    from vlm.config.train import load_train_config

    raw = config(tmp_path, name="zero_norm_eq", train={"max_steps": 1},
                 checkpoint={"every_steps": 0, "save_final": False})
    grads = Grads()
    with pytest.raises(StopTraining):
        fit_inprocess(load_train_config(raw=raw), callbacks=[grads])
    assert len(grads.pairs) >= 2  # decay / no-decay groups at least
    for ds, ours in grads.pairs:
        assert ds > 0 and ours == pytest.approx(ds, rel=1e-5), grads.pairs


@pytest.mark.parametrize("norm,loss_scale,clip", [(0.5, 1.0, 1.0), (3.0, 1.0, 1.0), (3.0, 1.0, 0.0),
                                                  (6.0, 2.0, 1.0), (math.inf, 1.0, 1.0), (-1.0, 1.0, 1.0)])
def test_combined_scale_is_deepspeeds(norm, loss_scale, clip):
    """The factor DeepSpeed's ``unscale_and_clip_grads`` divides by, with the norm as a tensor (its path)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    class Opt:  # the three fields DeepSpeed's method reads
        device = "cpu"

    opt = Opt()
    opt.clip_grad, opt.loss_scale = clip, loss_scale
    g_ds, g_ours = torch.ones(4), torch.ones(4)
    DeepSpeedZeroOptimizer.unscale_and_clip_grads(opt, [g_ds], torch.tensor(norm))
    g_ours.mul_(1.0 / combined_scale(norm, loss_scale, clip))
    torch.testing.assert_close(g_ours, g_ds, rtol=1e-6, atol=0)


@pytest.mark.parametrize("chunking", [False, True], ids=["moe", "conceptmoe"])
def test_trainer_step_reads_the_device_once_for_the_norm(tmp_path, chunking):
    """The trainer's whole optimizer step (forward, backward, ZeRO-2 step) on a packed batch with the host
    layout: no unnamed host read, and the optimizer's only read is the named global norm."""
    from benchmarks.op_counter import OpCounter
    from benchmarks.overhead import OursStep, count_step

    step = OursStep(chunking, 128, 1, tmp_path, torch.device("cpu"), torch.float32, {"num_hidden_layers": 5})
    try:
        oc: OpCounter = count_step(step, "ours")
    finally:
        step.close()
    assert oc.unnamed_syncs() == [], oc.unnamed_syncs()
    in_step = [why for op, why, where in oc.reads if "zero_norm" in where or "deepspeed" in where]
    assert in_step == [NORM_READ]
    per_parameter = [op for phase, _, op, where in oc.ops if phase == "optimizer step" and op == "linalg_vector_norm"
                     and "stage_1_and_2.py" in where]
    assert per_parameter == []  # DeepSpeed's norm per parameter (one foreach norm per group instead)


class Clipped(Callback):
    """At the first micro-batch, after backward: each group's flat gradient clipped by DeepSpeed's own norm and
    ``unscale_and_clip_grads``, and by the installed ones (the step's float norm), from the same gradients."""

    def __init__(self):
        self.rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.norm: float | None = None

    def on_micro_batch(self, trainer, out, batch) -> None:
        if trainer.step == 0:
            from deepspeed.runtime.utils import combine_grad_norm_groups
            from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Zero

            opt = trainer.engine.optimizer
            trainer.engine.backward(out.loss)
            groups = range(len(opt.bit16_groups))
            norm_ds = combine_grad_norm_groups([Zero.get_grad_norm_direct(
                opt, opt.averaged_gradients[i], opt.params_in_partition[i]) for i in groups], norm_type=2)
            self.norm = opt.scaled_global_norm()
            for i in groups:
                flat = torch.cat([g.detach().flatten() for g in opt.averaged_gradients[i]])
                g_ds, g_ours = flat.clone(), flat.clone()
                Zero.unscale_and_clip_grads(opt, [g_ds], norm_ds)
                opt.unscale_and_clip_grads([g_ours], self.norm)
                self.rows.append((flat, g_ds, g_ours))
            raise StopTraining


def test_clipped_gradients_equal_deepspeeds_above_max_norm(tmp_path):
    """A norm far above ``grad_clip``: the installed clip (from the step's one float norm) scales each flat
    gradient as DeepSpeed's own norm and clip do, and it did clip."""
    from vlm.config.train import load_train_config

    raw = config(tmp_path, name="zero_clip_eq", train={"max_steps": 1, "grad_clip": 1e-3},
                 checkpoint={"every_steps": 0, "save_final": False})
    clipped = Clipped()
    with pytest.raises(StopTraining):
        fit_inprocess(load_train_config(raw=raw), callbacks=[clipped])
    assert isinstance(clipped.norm, float) and clipped.norm > 1e-2  # the float: zero_norm.py's path is installed
    assert len(clipped.rows) >= 2
    for flat, g_ds, g_ours in clipped.rows:
        assert not torch.equal(g_ds, flat)  # clipped
        torch.testing.assert_close(g_ours, g_ds, rtol=1e-5, atol=0)
