"""scripts/gpu_check.sh without a GPU: its dry run lists every step, and the configs of its MFU step
load (a ~1B-total-parameter ConceptMoE, packed 8K rows of real documents)."""
from __future__ import annotations

import os
import subprocess

from vlm.config.train import REPO_ROOT, load_train_config


def test_dry_run_lists_the_steps():
    env = {**os.environ, "GPU_CHECK_DRY_RUN": "1"}
    out = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    for name in ("[tests]", "[train]", "[mfu-docs]", "[mfu-1b]", "[mfu-report]", "dry run done"):
        assert name in out.stdout, name
    assert "configs/train/gpu_mfu.yaml" in out.stdout


def test_mfu_preset_is_about_1b_parameters_at_8k_packed():
    from vlm.flops.accountant import count_params
    from vlm.training.model_setup import build_model_config

    cfg = load_train_config(REPO_ROOT / "configs" / "train" / "gpu_mfu.yaml")
    assert cfg.data.max_length == 8192 and cfg.precision == "bf16" and cfg.train.micro_batch_size == 1
    text = build_model_config(cfg)
    total = count_params(text)["total"]
    assert 0.9e9 <= total <= 1.1e9, total
