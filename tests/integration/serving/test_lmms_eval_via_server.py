"""lmms-eval's own ``openai`` chat model pointed at ``python -m vlm.serve`` scores the digits generation tasks as the
``conceptmoe_vlm`` plugin does, reply for reply, on a tiny export (scripts/eval_via_server.py: the server on a free
127.0.0.1 port, stopped at the end; both lmms-eval runs through its own CLI). Greedy fp32 on both sides and images
sent as PNG (lossless), so the replies must be identical, not just the scores: a server that mangled the image or
the prompt answers differently. The replies also differ between docs, so they do depend on the image and question."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _eval_helpers import default_data_dir, session_eval_data, tiny_export

from vlm.config.train import REPO_ROOT

pytest.importorskip("lmms_eval")
pytest.importorskip("fastapi")

TASKS = ("cmoe_digits_vqa", "cmoe_digits_mc_gen")
LIMIT = 6  # vqa: 2 images x 3 questions; mc_gen: 6 images, one question


def _replies(out, task: str) -> list[str]:
    (path,) = (out / "server").rglob(f"*_samples_{task}.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["filtered_resps"][0] if isinstance(r["filtered_resps"], list) else r["filtered_resps"] for r in rows]


def test_openai_model_through_the_server_scores_as_the_plugin(tmp_path, tmp_path_factory):
    export = tiny_export(tmp_path / "tiny")
    data = default_data_dir(tmp_path_factory)
    out = tmp_path / "run"
    cmd = [sys.executable, "scripts/eval_via_server.py", "--model", export, "--tasks", ",".join(TASKS),
           "--limit", str(LIMIT), "--data", data, "--eval-data", session_eval_data(tmp_path_factory),
           "--out", str(out), "--check-equal"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads((out / "summary.json").read_text())["tasks"]
    for task in TASKS:
        entry = summary[task]
        assert entry["samples"] == LIMIT and entry["same_replies"] == LIMIT, entry
        assert entry["plugin"] == entry["server"], entry
    # the replies carry the inputs: other questions on one image, other images for one question
    assert len(set(_replies(out, "cmoe_digits_vqa"))) > 1
    assert len(set(_replies(out, "cmoe_digits_mc_gen"))) > 1
    log = (out / "server.log").read_text()
    assert "Traceback" not in log


def test_multiple_choice_through_the_server_is_one_clear_error(tmp_path, tmp_path_factory):
    """cmoe_digits_mc is scored by loglikelihood, which lmms-eval's openai chat model cannot run."""
    export = tiny_export(tmp_path / "tiny")
    cmd = [sys.executable, "scripts/eval_via_server.py", "--model", export, "--tasks", "cmoe_digits_mc", "--limit", "2",
           "--data", default_data_dir(tmp_path_factory), "--eval-data", session_eval_data(tmp_path_factory),
           "--out", str(tmp_path / "run"), "--no-plugin"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    assert "openai model is a chat model: it runs generation tasks only" in proc.stderr
    assert "use cmoe_digits_mc_gen" in proc.stderr
