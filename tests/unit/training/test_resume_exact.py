"""Exact resume on the default config (configs/train/default.yaml: the mixture loader, the chunker's
boundary noise): a run interrupted after a checkpoint and resumed with ``--resume auto`` logs, step by
step, the same loss, gradient norm and learning rate as the uninterrupted run (equal, not close), and
ends on the same weights. One rank in this process; two ranks: tests/integration/training/test_resume_exact.py."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from vlm.config.train import REPO_ROOT, load_train_config
from vlm.training.trainer import Trainer
from _data_helpers import session_default_data
from _train_helpers import fit_inprocess

EXACT_KEYS = ("loss", "grad_norm", "lr", "tokens")


def default_overrides(root: str, out: Path) -> list[str]:
    """The default config, shortened to seconds: 5 steps of 4 samples, a checkpoint every 2 steps,
    on the default data built for this session, no evaluation, no export."""
    return [f"output_dir={out}", f"data.root={root}", f"model.tokenizer={root}/tokenizer", "eval.vqa_json=null",
            "train.max_steps=5", "train.micro_batch_size=4", "train.warmup_steps=2", "checkpoint.every_steps=2",
            "checkpoint.keep_last=5", "checkpoint.export_hf=false", "eval.every_steps=0", "log.every_steps=1",
            "log.progress_bar=false", "log.report_to=[jsonl]"]


def train(overrides: list[str], resume: str | None = None) -> Trainer:
    return fit_inprocess(load_train_config(REPO_ROOT / "configs" / "train" / "default.yaml", overrides), resume)


def step_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def module_weights(ckpt_step: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt_step / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]


def test_interrupted_and_resumed_run_equals_the_uninterrupted_run(tmp_path_factory, tmp_path):
    """Interrupted after step 3 with step 2 as its newest checkpoint (no final save, as after a crash):
    the resumed run redoes step 3 and goes on to 5. Every step of both processes equals the
    uninterrupted run's, bit for bit; the final weights too."""
    root = session_default_data(tmp_path_factory)
    base = default_overrides(root, tmp_path)
    train(base + ["name=whole"])
    train(base + ["name=cut", "train.stop_at_step=3", "checkpoint.save_final=false"])
    resumed = train(base + ["name=cut"], resume="auto")
    assert resumed.resumed_from.endswith("step_000002")

    whole = {r["step"]: r for r in step_records(tmp_path / "whole")}
    cut = step_records(tmp_path / "cut")
    assert sorted(whole) == [1, 2, 3, 4, 5] and [r["step"] for r in cut] == [1, 2, 3, 3, 4, 5]
    for rec in cut:
        ref = whole[rec["step"]]
        for key in EXACT_KEYS:
            assert rec[key] == ref[key], f"step {rec['step']}: {key} {rec[key]!r} resumed vs {ref[key]!r} uninterrupted"
    a = module_weights(tmp_path / "whole" / "ckpt" / "step_000005")
    b = module_weights(tmp_path / "cut" / "ckpt" / "step_000005")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
