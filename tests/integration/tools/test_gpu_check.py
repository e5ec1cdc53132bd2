"""scripts/gpu_check.sh without a GPU: its dry run lists every step (the config of its MFU step, a
~1B-total-parameter ConceptMoE on packed 8K rows: tests/unit/config/test_train_config.py)."""
from __future__ import annotations

import os
import subprocess

from vlm.config.train import REPO_ROOT


def test_dry_run_lists_the_steps():
    env = {**os.environ, "GPU_CHECK_DRY_RUN": "1"}
    out = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    for name in ("[tests]", "[train]", "[mfu-docs]", "[mfu-1b]", "[mfu-report]", "dry run done"):
        assert name in out.stdout, name
    assert "configs/train/gpu_mfu.yaml" in out.stdout


def test_bare_machine_without_kit_is_one_line_and_leaves_a_summary(tmp_path):
    """No .venv-like python (a plain interpreter without deepspeed / pydantic) and no kit: one line
    naming `make gpu-kit`, exit 2, and the summary + log already in the output folder."""
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python3").write_text("#!/bin/sh\nexec /usr/bin/env -i /bin/sh -c 'exit 1'\n")  # imports nothing
    (bare / "python3").chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PY": str(bare / "python3"), "GPU_CHECK_KIT": str(tmp_path / "no_kit"),
           "GPU_CHECK_OUT": str(out), "DEVICE": "cuda"}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "make gpu-kit" in proc.stdout and "carry .gpu_kit" in proc.stdout
    assert "FAILED" in (out / "summary.txt").read_text()
    assert "make gpu-kit" in (out / "gpu_check.log").read_text()


def test_dry_run_installs_the_kit_with_pip_target_and_never_runs_make():
    env = {**os.environ, "GPU_CHECK_DRY_RUN": "1"}
    out = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=60).stdout
    assert "--no-index --no-deps" in out and "--target" in out and ".gpu_kit" in out
    assert "make " not in out and "make\n" not in out
