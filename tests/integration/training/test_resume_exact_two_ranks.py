"""Exact resume on two ranks (torchrun --standalone, gloo) with the default config: each rank's mixture
loader position and RNG states come back, so the resumed steps equal the uninterrupted ones bit for
bit (one rank, in process: tests/unit/training/test_resume_exact.py)."""
from __future__ import annotations

import _train_helpers as helpers
from _data_helpers import session_default_data

from vlm.config.train import REPO_ROOT

EXACT_KEYS = ("loss", "grad_norm", "lr", "tokens")


def test_two_ranks_interrupted_and_resumed_equal_the_uninterrupted_steps(tmp_path_factory, tmp_path):
    """A 2-rank run of the default config (5 steps of 4 samples per rank) stops after step 4 with
    step 2 as its newest checkpoint (no final save, as after a crash), so it is the uninterrupted run
    up to step 4; ``--resume auto`` redoes steps 3 and 4 and goes on to 5. The redone steps' loss,
    gradient norm, lr and token count equal the first run's exactly."""
    root = session_default_data(tmp_path_factory)
    args = [f"output_dir={tmp_path}", "name=cut", f"data.root={root}", f"model.tokenizer={root}/tokenizer",
            "eval.vqa_json=null", "train.max_steps=5", "train.micro_batch_size=4", "train.warmup_steps=2",
            "checkpoint.every_steps=2", "checkpoint.save_final=false", "checkpoint.export_hf=false",
            "eval.every_steps=0", "log.every_steps=1", "log.progress_bar=false", "log.report_to=[jsonl]"]
    config = REPO_ROOT / "configs" / "train" / "default.yaml"
    first = helpers.launch(config, nproc=2, args=[*args, "train.stop_at_step=4"], timeout=300)
    assert first.returncode == 0, first.stdout[-4000:]
    second = helpers.launch(config, nproc=2, args=[*args, "--resume", "auto"], timeout=300)
    assert second.returncode == 0, second.stdout[-4000:]
    assert "resumed from" in second.stdout and "step_000002" in second.stdout, second.stdout[-4000:]
    recs = helpers.records(tmp_path / "cut")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 3, 4, 5]
    for before, again in zip(recs[2:4], recs[4:6]):
        for key in EXACT_KEYS:
            assert again[key] == before[key], (f"step {again['step']}: {key} {again[key]!r} resumed vs "
                                               f"{before[key]!r} uninterrupted")
