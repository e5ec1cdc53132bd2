"""A DeepSpeed other than the tested one (vlm/training/ds_compat.py): simulated by monkeypatching the installed
one (the step's non-finite skip gone, a patched method renamed, a signature changed), the patch that relied on it
is left out with one log line, and a NaN gradient still never reaches the weights, in fp32 and bf16."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _train_helpers import config, fit_inprocess
from test_overflow_check import NaNGradientAt

from vlm.training.ds_compat import TESTED, version_difference

DIFFERS = "differs from the one the ZeRO-1/2 patches were tested on"


def test_pyproject_range_is_the_tested_one_and_holds_the_installed_deepspeed():
    import deepspeed

    pyproject = (Path(__file__).parents[3] / "pyproject.toml").read_text()
    assert [ln.split('"')[1] for ln in pyproject.splitlines() if ln.strip().startswith('"deepspeed')] == \
        [f"deepspeed{TESTED}"]
    assert version_difference(deepspeed.__version__) is None
    assert [version_difference(v) is None for v in ("0.19.8", "0.19.9+cu", "0.19.10", "0.19.7", "0.20.0rc1",
                                                       "0.16.4", "1.0", "x")] == [True, True, True] + [False] * 5


def _fit_nan_at_2(tmp_path, monkeypatch, precision: str, **raw):
    """Three steps with a NaN gradient (finite loss) at step 2; the trainer, the NaN callback, the log lines."""
    from vlm.config.train import load_train_config
    from vlm.training.callbacks.defaults import default_callbacks
    from vlm.training.trainer import Trainer

    lines: list[str] = []
    monkeypatch.setattr(Trainer, "log_line", lambda self, text: lines.append(text))
    cfg = config(tmp_path, name=f"dscompat_{precision}", precision=precision, train={"max_steps": 3, **raw.pop(
        "train", {})}, checkpoint={"every_steps": 0, "save_final": False}, **raw)
    nan = NaNGradientAt(2)
    trainer = fit_inprocess(load_train_config(raw=cfg), callbacks=[nan, *default_callbacks()])
    return trainer, nan, lines


def _assert_nan_step_skipped(trainer, nan):
    assert trainer.progress.step == 3 and trainer.progress.skipped_steps == 1
    assert all(torch.equal(nan.before[k], nan.after[k]) for k in nan.before), "the NaN step moved weights"
    bad = [n for n, p in trainer.engine.module.named_parameters() if not torch.isfinite(p).all()]
    assert bad == [], bad[:3]


def _skip_gone(monkeypatch):
    """A ZeRO-1/2 step() that no longer skips on a non-finite global norm."""
    from deepspeed.runtime.zero import stage_1_and_2

    monkeypatch.setattr(stage_1_and_2, "is_invalid_grad_norm", lambda norm: False)


def _norm_method_renamed(monkeypatch):
    """get_grad_norm_direct renamed (grad_norm_of), its caller scaled_global_norm following the rename."""
    from deepspeed.runtime.utils import combine_grad_norm_groups
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Zero

    monkeypatch.setattr(Zero, "grad_norm_of", Zero.get_grad_norm_direct, raising=False)
    monkeypatch.delattr(Zero, "get_grad_norm_direct")

    def scaled_global_norm(self, norm_type=2):
        norms = [self.grad_norm_of(self.averaged_gradients[i], self.params_in_partition[i])
                 for i in range(len(self.bit16_groups))]
        return combine_grad_norm_groups(norms, norm_type=norm_type)
    monkeypatch.setattr(Zero, "scaled_global_norm", scaled_global_norm)


def _reduction_signature_changed(monkeypatch):
    """allreduce_and_copy with one more parameter."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Zero

    original = Zero.allreduce_and_copy

    def allreduce_and_copy(self, small_bucket, communication_data_type, rank=None, log=None, divide=True,
                           process_group=None, output_bucket=None, stream=None):
        return original(self, small_bucket, communication_data_type, rank=rank, log=log, divide=divide,
                        process_group=process_group, output_bucket=output_bucket)
    monkeypatch.setattr(Zero, "allreduce_and_copy", allreduce_and_copy)


UPGRADES = {  # simulated upgrade -> (patch flags on the trainer as (overflow, norm, one rank), what the line names)
    "skip_gone": (_skip_gone, (False, False, True), "no longer skips on a global norm of nan"),
    "norm_renamed": (_norm_method_renamed, (True, False, True), "get_grad_norm_direct is missing"),
    "reduction_signature": (_reduction_signature_changed, (True, True, False), "allreduce_and_copy("),
}


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("upgrade", list(UPGRADES))
def test_simulated_upgrade_falls_back_with_one_line_and_skips_the_nan_step(tmp_path, monkeypatch, upgrade, precision):
    simulate, flags, named = UPGRADES[upgrade]
    simulate(monkeypatch)
    trainer, nan, lines = _fit_nan_at_2(tmp_path, monkeypatch, precision)
    flags = (flags[0] and precision == "bf16", *flags[1:])  # fp32: DeepSpeed has no per-partition check to drop
    assert (trainer.norm_overflow_check, trainer.one_norm_read, trainer.single_rank_reduction_skipped) == flags
    said = [line for line in lines if DIFFERS in line]
    assert len(said) == 1 and named in said[0], lines
    _assert_nan_step_skipped(trainer, nan)


def test_tested_deepspeed_installs_every_patch_without_a_line(tmp_path, monkeypatch):
    trainer, nan, lines = _fit_nan_at_2(tmp_path, monkeypatch, "bf16")
    assert (trainer.norm_overflow_check, trainer.one_norm_read, trainer.single_rank_reduction_skipped) == \
        (True, True, True)
    assert [line for line in lines if DIFFERS in line] == []
    _assert_nan_step_skipped(trainer, nan)


@pytest.mark.parametrize("compute_grad_norm", [False, True])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_overflow_patch_keeps_the_only_nan_check_without_a_global_norm(tmp_path, monkeypatch, precision,
                                                                       compute_grad_norm):
    """gradient_clipping 0, and the norm not computed at all: without the norm the per-partition check is the
    only one, so it stays (and the NaN step is skipped)."""
    trainer, nan, lines = _fit_nan_at_2(
        tmp_path, monkeypatch, precision, train={"grad_clip": 0.0},
        deepspeed_overrides={"zero_optimization": {"compute_grad_norm": compute_grad_norm}})
    assert trainer.norm_overflow_check is (compute_grad_norm and precision == "bf16")
    assert [line for line in lines if DIFFERS in line] == []
    _assert_nan_step_skipped(trainer, nan)


def test_missing_attributes_and_an_older_version_leave_each_patch_out(tmp_path, monkeypatch):
    """On the engine's own optimizer: an attribute a patch reads gone (compute_grad_norm: an older DeepSpeed), a
    version outside the range."""
    import deepspeed

    from vlm.config.train import load_train_config
    from vlm.training.ds_compat import differences, fallback_line
    from vlm.training.overflow import use_norm_overflow_check
    from vlm.training.zero_norm import use_one_norm_read

    raw = config(tmp_path, name="dscompat_attrs", train={"max_steps": 1},
                 checkpoint={"every_steps": 0, "save_final": False})
    opt = fit_inprocess(load_train_config(raw=raw)).engine.optimizer
    assert differences(opt) == {}
    monkeypatch.delattr(opt, "compute_grad_norm")
    assert {p: "compute_grad_norm is missing" in why for p, why in differences(opt).items()} == \
        {"overflow": True, "norm": True}
    del opt._vlm_ds_differences  # as at engine build on that DeepSpeed: the patches leave it be, no AttributeError
    assert (use_norm_overflow_check(opt), use_one_norm_read(opt), fallback_line(opt) is not None) == (False, False, True)
    monkeypatch.undo()
    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    assert set(differences(opt)) == {"overflow", "norm", "one_rank"}
    opt._vlm_ds_differences = differences(opt)
    assert fallback_line(opt).endswith("the overflow check (overflow.py), the gradient norm (zero_norm.py), the one-rank "
                                       "reduction (one_rank.py): DeepSpeed 0.20.1 is outside the tested range "
                                       ">=0.19.8,<0.20")
