"""A non-finite gradient skips the step from the global-norm check alone (vlm/training/overflow.py): in bf16
(check_grad_overflow) and fp32, with a finite loss and a NaN gradient, the step is skipped, the weights do
not move, and DeepSpeed's per-partition has_inf_or_nan loop never runs."""
from __future__ import annotations

import pytest
import torch

from _train_helpers import config, fit_inprocess
from vlm.training.callbacks.base import Callback


class NaNGradient(torch.autograd.Function):
    """Identity forward; NaN gradient backward (the loss stays finite)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


class NaNGradientAt(Callback):
    def __init__(self, step: int):
        self.step = step
        self.before: dict | None = None
        self.after: dict | None = None

    def _weights(self, trainer) -> dict:
        return {k: v.detach().float().clone() for k, v in trainer.engine.module.state_dict().items()}

    def on_step_start(self, trainer) -> None:
        if trainer.step + 1 == self.step:
            self.before = self._weights(trainer)

    def on_micro_batch(self, trainer, out, batch) -> None:
        if trainer.step + 1 == self.step:
            out.loss = NaNGradient.apply(out.loss)

    def on_step_end(self, trainer, step) -> None:
        if step.step == self.step:
            self.after = self._weights(trainer)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_nan_gradient_skips_the_step_without_the_per_partition_check(tmp_path, monkeypatch, precision):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from vlm.config.train import load_train_config
    from vlm.training.callbacks.defaults import default_callbacks

    def per_partition(self):
        raise AssertionError("the per-partition overflow check ran")
    monkeypatch.setattr(DeepSpeedZeroOptimizer, "has_overflow_partitioned_grads_serial", per_partition)
    raw = config(tmp_path, name=f"nangrad_{precision}", precision=precision, train={"max_steps": 3},
                 checkpoint={"every_steps": 0, "save_final": False})
    nan = NaNGradientAt(2)
    checked = []

    class NormCheckOn(Callback):  # the engine's optimizer as the trainer set it up, before the first step
        def on_fit_start(self, trainer) -> None:
            checked.append(trainer.norm_overflow_check)
    trainer = fit_inprocess(load_train_config(raw=raw), callbacks=[nan, NormCheckOn(), *default_callbacks()])
    assert checked == [precision == "bf16"]  # fp32: DeepSpeed checks the norm only
    p = trainer.progress
    assert p.step == 3 and p.skipped_steps == 1
    assert all(torch.equal(nan.before[k], nan.after[k]) for k in nan.before), "the skipped step moved weights"
