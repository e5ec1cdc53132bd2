"""Training config: YAML + dotted overrides, one-line errors naming the key, stage YAMLs, DS JSONs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vlm.modeling.config_base import ConfigError
from vlm.training.distributed import build_ds_config
from vlm.config.train import load_train_config

ROOT = Path(__file__).resolve().parents[3]
TRAIN = ROOT / "configs" / "train"


def test_default_yaml_and_overrides():
    cfg = load_train_config(TRAIN / "default.yaml", ["train.lr=1e-3", "data.max_length=256", "model.num_experts=16",
                                                     "model.vision.backbone=small-vit", "deepspeed=zero3",
                                                     "train.lr_mult.vision=0.1", "train.freeze.vision=true"])
    assert cfg.train.lr == 1e-3 and isinstance(cfg.train.lr, float)  # YAML reads "1e-3" as a string
    assert cfg.data.max_length == 256
    assert cfg.model.overrides["num_experts"] == 16
    assert cfg.model.overrides["vision.backbone"] == "small-vit"
    assert cfg.deepspeed == "zero3" and cfg.deepspeed_json().name == "zero3.json"
    assert cfg.train.lr_mult.vision == 0.1 and cfg.train.freeze.vision is True
    assert cfg.run_dir == Path("runs") / "train-vlm"


@pytest.mark.parametrize("override, key", [
    ("train.lrr=1", "train.lrr"),
    ("nonsense=1", "nonsense"),
    ("data.max_lenght=3", "data.max_lenght"),
    ("log.every=3", "log.every"),
    ("train.lr_mult.visoin=1", "train.lr_mult.visoin"),
])
def test_unknown_key_is_one_line_naming_it(override, key):
    with pytest.raises(ConfigError) as info:
        load_train_config(TRAIN / "default.yaml", [override])
    msg = str(info.value)
    assert "\n" not in msg and f"{key}: unknown config key" in msg


@pytest.mark.parametrize("override, key", [
    ("train.max_steps=abc", "train.max_steps"),
    ("train.stage=pretrain", "train.stage"),
    ("train.max_steps=0", "train.max_steps"),
    ("precision=fp8", "precision"),
    ("deepspeed=zero9", "deepspeed"),
    ("train.betas=[0.9]", "train.betas"),
    ("train.lr", "train.lr"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as info:
        load_train_config(TRAIN / "default.yaml", [override])
    assert key in str(info.value) and "\n" not in str(info.value)


def test_unknown_model_key_is_reported_by_the_model_config():
    from vlm.training.build import build_model_config

    cfg = load_train_config(TRAIN / "default.yaml", ["model.num_expertz=4", "model.tokenizer=null"])
    with pytest.raises(ConfigError) as info:
        build_model_config(cfg)
    assert "model.num_expertz" in str(info.value) and "\n" not in str(info.value)


def test_stage_yamls_inherit_default():
    for stage in ("align", "finetune", "full"):
        cfg = load_train_config(TRAIN / f"{stage}.yaml")
        assert cfg.train.stage == stage
        assert cfg.model.kind == "vlm"
        assert cfg.name == f"vlm-{stage}"


def test_deepspeed_json_filled_from_yaml():
    for zero in ("zero1", "zero2", "zero3"):
        raw = json.loads((ROOT / "configs" / "deepspeed" / f"{zero}.json").read_text())
        assert raw["zero_optimization"]["stage"] == int(zero[-1])
        assert raw["bf16"]["enabled"] is True  # GPU default; the trainer switches CPU runs to fp32
        cfg = load_train_config(TRAIN / "default.yaml", [f"deepspeed={zero}", "train.grad_accum=4",
                                                         "train.micro_batch_size=3", "train.grad_clip=0.5"])
        ds = build_ds_config(cfg, world_size=2, bf16=False)
        assert ds["train_batch_size"] == 3 * 4 * 2 and ds["gradient_accumulation_steps"] == 4
        assert ds["train_micro_batch_size_per_gpu"] == 3 and ds["gradient_clipping"] == 0.5
        assert ds["bf16"]["enabled"] is False and "optimizer" not in ds and "scheduler" not in ds
    cfg = load_train_config(TRAIN / "default.yaml",
                            ["deepspeed=zero3", "deepspeed_overrides.zero_optimization.stage3_param_persistence_threshold=0"])
    ds = build_ds_config(cfg, world_size=1, bf16=True)
    assert ds["zero_optimization"]["stage3_param_persistence_threshold"] == 0 and ds["bf16"]["enabled"] is True


def test_overlap_comm_is_off_on_one_rank_unless_asked_for():
    """With one rank ZeRO has no gradient reduction to overlap, and overlap_comm would synchronize the device
    after every backward: off at world size 1, kept on several ranks and when deepspeed_overrides sets it."""
    for zero in ("zero2", "zero3"):
        cfg = load_train_config(TRAIN / "default.yaml", [f"deepspeed={zero}"])
        assert build_ds_config(cfg, world_size=1, bf16=True)["zero_optimization"]["overlap_comm"] is False
        assert build_ds_config(cfg, world_size=2, bf16=True)["zero_optimization"]["overlap_comm"] is True
        cfg = load_train_config(TRAIN / "default.yaml", [f"deepspeed={zero}",
                                                         "deepspeed_overrides.zero_optimization.overlap_comm=true"])
        assert build_ds_config(cfg, world_size=1, bf16=True)["zero_optimization"]["overlap_comm"] is True


def test_adamw_is_fused():
    from vlm.training.optim import build_optimizer

    cfg = load_train_config(TRAIN / "default.yaml")
    opt = build_optimizer(torch.nn.Linear(4, 4), cfg)
    assert opt.defaults["fused"] is True and opt.defaults["foreach"] is None


def test_gpu_mfu_preset_is_about_1b_parameters_at_8k_packed():
    """The config of scripts/gpu_check.sh's MFU step: a ~1B-total-parameter ConceptMoE, packed 8K rows."""
    from vlm.flops.accountant import count_params
    from vlm.training.build import build_model_config

    cfg = load_train_config(TRAIN / "gpu_mfu.yaml")
    assert cfg.data.max_length == 8192 and cfg.precision == "bf16" and cfg.train.micro_batch_size == 20
    total = count_params(build_model_config(cfg))["total"]
    assert 0.9e9 <= total <= 1.1e9, total
