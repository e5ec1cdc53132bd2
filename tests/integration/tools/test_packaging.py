"""pyproject.toml builds its metadata with the installed setuptools without a deprecation warning (the
editable install of `make setup` runs the same hook), and the licence is an SPDX expression."""
from __future__ import annotations

import shutil
import subprocess
import sys

from vlm.config.train import REPO_ROOT

HOOK = ("import sys; from setuptools import build_meta; "
        "print(build_meta.prepare_metadata_for_build_editable(sys.argv[1]))")


def test_editable_metadata_builds_without_deprecation_warnings(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir(), out.mkdir()
    for name in ("pyproject.toml", "README.md"):  # a copy: the hook writes egg-info beside the project
        shutil.copy(REPO_ROOT / name, src / name)
    run = subprocess.run([sys.executable, "-W", "always", "-c", HOOK, str(out)], cwd=src,
                         capture_output=True, text=True, timeout=120)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-2000:]
    assert "deprecat" not in log.lower(), log[-3000:]
    metadata = (out / run.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
