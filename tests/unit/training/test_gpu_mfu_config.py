"""The GPU check's MFU step measures what it says: each optimizer step of configs/train/gpu_mfu.yaml trains
>= 16K real tokens (packed 8K rows of whole documents), the figure is taken once the router is steady, and
the profiler window (``log.profile_steps``) writes the GPU idle fraction and the top kernels / ops."""
from __future__ import annotations

import json

import pytest
import torch

from scripts.gpu_mfu import is_steady, write_docs
from _train_helpers import config, run_inprocess
from vlm.config.train import REPO_ROOT, load_train_config
from vlm.modeling.config_base import ConfigError
from vlm.training.callbacks.profile_window import busy_time

MIN_TOKENS_PER_STEP = 16_384


def test_every_mfu_step_trains_at_least_16k_real_tokens(tmp_path):
    from vlm.training.build import load_tokenizer
    from vlm.training.data import build_loader

    write_docs(tmp_path / "docs.jsonl")
    cfg = load_train_config(REPO_ROOT / "configs" / "train" / "gpu_mfu.yaml",
                            [f"data.datasets=[{{name: scenes, type: text, path: {tmp_path}/docs.jsonl, weight: 1.0}}]"])
    loader = build_loader(cfg, None, None, load_tokenizer(cfg.model.tokenizer), None, 0, 1)
    batches = iter(loader)
    tokens = []
    for _ in range(cfg.train.max_steps * cfg.train.grad_accum):
        batch = next(batches)
        assert batch["input_ids"].shape[1] <= 8192
        tokens.append(int(batch["attention_mask"].sum()))
    per_step = [sum(tokens[i:i + cfg.train.grad_accum]) for i in range(0, len(tokens), cfg.train.grad_accum)]
    assert min(per_step) >= MIN_TOKENS_PER_STEP, (min(per_step), per_step)
    # the measured window (the last log window) lies after the profiled steps, which lie after the warm-up
    first, last = cfg.log.profile_steps
    assert cfg.train.warmup_steps < first <= last <= cfg.train.max_steps - cfg.log.every_steps


def test_the_window_counts_only_once_the_router_is_steady():
    assert is_steady(2.1, 2.0) and is_steady(1.85, 2.0) and is_steady(None, None)
    assert not is_steady(1.35, 2.0) and not is_steady(7.6, 2.0) and not is_steady(None, 2.0)


def test_busy_time_is_the_union_of_kernel_intervals():
    assert busy_time([]) == 0
    assert busy_time([(0, 10), (5, 15), (20, 30)]) == 25  # overlap counted once, the gap not at all
    assert busy_time([(20, 30), (0, 100)]) == 100


def test_profile_steps_must_be_ordered(tmp_path):
    with pytest.raises(ConfigError, match="log.profile_steps"):
        load_train_config(raw=config(tmp_path, log={"profile_steps": [3, 2]}))


def test_profile_window_writes_its_steps_and_top_ops(tmp_path):
    raw = config(tmp_path, name="prof", train={"max_steps": 4}, log={"profile_steps": [2, 3]},
                 checkpoint={"every_steps": 0, "save_final": False})
    trainer = run_inprocess(raw, tmp_path)
    rec = json.loads((trainer.run_dir / "profile.json").read_text())
    assert rec["steps"] == [2, 3] and rec["device"] == "cpu" and rec["gpu_idle_fraction"] is None
    assert rec["window_s"] > 0 and rec["top"] and all(t["ms_per_step"] > 0 for t in rec["top"])
    assert any("mm" in t["name"] for t in rec["top"])  # the step's matmuls are in the window


def test_profile_window_holds_exactly_its_steps(tmp_path):
    """``log.profile_steps: [2, 3]`` over steps 1..5 driven as ``Trainer.fit`` does (``on_step_start``
    sees the step before it, ``on_step_end`` the step taken): the window holds the work of steps 2 and 3
    and no other, one matmul per step. (The end-to-end test above reads back only the configured pair.)"""
    rec, lines = _drive_profile_window(tmp_path, [2, 3], start=0, stop=5)
    top = {t["name"]: t["calls_per_step"] for t in rec["top"]}
    assert rec["steps"] == [2, 3] and len(lines) == 1, (rec["steps"], lines)
    assert sorted(k for k in top if k.startswith("work_of_step_")) == ["work_of_step_2", "work_of_step_3"], top
    assert top["aten::mm"] == 1.0, top


def test_a_run_resumed_inside_the_window_profiles_the_rest_of_it(tmp_path):
    """Resumed after step 2 with ``log.profile_steps: [2, 4]``: steps 3 and 4 are profiled and the record
    says so; resumed after the window (step 5): no profile.json, and one line says why."""
    rec, lines = _drive_profile_window(tmp_path, [2, 4], start=2, stop=6)
    assert rec is not None, f"resumed inside the window, nothing profiled: {lines}"
    top = {t["name"]: t["calls_per_step"] for t in rec["top"]}
    assert rec["steps"] == [3, 4] and top["aten::mm"] == 1.0, (rec["steps"], top)
    assert sorted(k for k in top if k.startswith("work_of_step_")) == ["work_of_step_3", "work_of_step_4"], top
    assert lines[0].startswith("[train] profile of steps 3-4:"), lines
    (tmp_path / "profile.json").unlink()
    _, lines = _drive_profile_window(tmp_path, [2, 4], start=5, stop=6)
    assert lines == [("[train] log.profile_steps [2, 4]: this run starts after step 5, past the window: "
                      "nothing profiled")], lines
    assert not (tmp_path / "profile.json").exists()


def _drive_profile_window(tmp_path, steps, start: int, stop: int):
    """``ProfileWindow`` driven as ``Trainer.fit`` does from step ``start`` to ``stop`` (``on_step_start``
    sees the step before it, ``on_step_end`` the step taken), each step one recorded matmul. Returns the
    profile.json record (None when none was written) and the logged lines."""
    from types import SimpleNamespace

    from torch.profiler import record_function

    from vlm.training.callbacks.base import StepEnd
    from vlm.training.callbacks.profile_window import ProfileWindow

    lines = []
    trainer = SimpleNamespace(cfg=SimpleNamespace(log=SimpleNamespace(profile_steps=steps)), is_main=True,
                              device="cpu", run_dir=tmp_path, log_line=lines.append, step=start)
    window, a = ProfileWindow(), torch.randn(8, 8)
    window.on_fit_start(trainer)
    for n in range(start + 1, stop + 1):
        window.on_step_start(trainer)
        with record_function(f"work_of_step_{n}"):
            torch.mm(a, a)
        trainer.step = n
        window.on_step_end(trainer, StepEnd(step=n, skipped=False, last=n == stop))
    window.close()
    path = tmp_path / "profile.json"
    return (json.loads(path.read_text()) if path.exists() else None), lines
