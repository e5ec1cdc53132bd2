"""Atomic checkpoints: the save protocol, the ``latest`` pointer, keep-last-K, discovery after crashes,
RNG state round trip and its restore on resume, and a real kill -9 during a save followed by ``--resume auto``."""
from __future__ import annotations

import json
import random

import _train_helpers as helpers
import numpy as np
import pytest
import torch
from _ckpt import FakeEngine
from _ckpt import save as _save

from vlm.training import checkpoint as ckpt
from vlm.training.callbacks.base import Callback


def test_save_rename_pointer_and_keep_last(tmp_path):
    eng = FakeEngine()
    for step in (1, 2, 3, 4):
        path = _save(eng, tmp_path, step)
        assert path.name == f"step_{step:06d}" and ckpt.is_complete(path)
        assert (tmp_path / "latest").read_text().strip() == path.name
        assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000003", "step_000004"]
    assert ckpt.find_checkpoint(tmp_path).name == "step_000004"
    state = json.loads((tmp_path / "step_000004" / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["world_size"] == 1
    _trainer_state, rank_state = ckpt.load(eng, tmp_path / "step_000004", rank=0, world_size=1)
    assert eng.loaded == tmp_path / "step_000004" and rank_state["data"] == {"index": 4}
    with pytest.raises(ckpt.ResumeError, match="same world size"):
        ckpt.load(eng, tmp_path / "step_000004", rank=0, world_size=2)


def test_another_world_size_refusals_are_one_line(tmp_path):
    """``reshard.prepare`` (the trainer calls it before building the engine): ZeRO stage 0 and expert
    parallelism are refused, and a folder DeepSpeed's converter cannot read (here: fake engine files, no ZeRO optimizer
    shards) stops with one line and leaves no ``universal`` / ``universal.tmp`` folder behind."""
    from vlm.training import reshard

    path = _save(FakeEngine(), tmp_path, 2)
    assert reshard.prepare(path, 1, 2, {}, rank=0, log_line=print) is None  # same world size: nothing to do
    with pytest.raises(ckpt.ResumeError, match="cannot resume on 2 ranks under ZeRO stage 0") as err:
        reshard.prepare(path, 2, 0, {}, rank=0, log_line=print)
    assert "\n" not in str(err.value)
    with pytest.raises(ckpt.ResumeError, match="expert_parallel_size 2: resuming at another world size covers data"):
        reshard.prepare(path, 2, 2, {}, rank=0, log_line=print, expert_parallel=2)
    ds: dict = {}
    with pytest.raises(reshard.ReshardError, match="universal checkpoint converter cannot convert") as err:
        reshard.prepare(path, 2, 2, ds, rank=0, log_line=print)
    assert "\n" not in str(err.value) and ds == {}
    assert not (path / "universal").exists() and not (path / "universal.tmp").exists() and ckpt.is_complete(path)


def test_discovery_ignores_partial_saves(tmp_path):
    eng = FakeEngine()
    _save(eng, tmp_path, 2)
    # a save killed midway: the .tmp folder holds engine files and maybe rank files, no rename
    eng.save_checkpoint(tmp_path, "step_000004.tmp", save_latest=False)
    (tmp_path / "step_000004.tmp" / "rank_00000.json").write_text("{}")
    # a folder without trainer_state.json (e.g. copied by hand) is not complete either
    (tmp_path / "step_000005").mkdir()
    assert ckpt.find_checkpoint(tmp_path).name == "step_000002"
    assert ckpt.resolve_resume("auto", tmp_path).name == "step_000002"
    assert ckpt.resolve_resume(str(tmp_path), "unused").name == "step_000002"
    with pytest.raises(FileNotFoundError):
        ckpt.resolve_resume(str(tmp_path / "step_000004.tmp"), tmp_path)
    with pytest.raises(FileNotFoundError):
        ckpt.resolve_resume(str(tmp_path / "step_000005"), tmp_path)
    # the next save of step 4 replaces the stale .tmp and prunes the junk
    _save(eng, tmp_path, 4)
    assert ckpt.find_checkpoint(tmp_path).name == "step_000004"
    assert not (tmp_path / "step_000004.tmp").exists()


def test_resume_from_a_folder_without_a_complete_checkpoint_is_refused(tmp_path):
    """``--resume DIR`` where DIR holds only partial saves (a killed .tmp, a folder without trainer state,
    a pointer to it): one line naming DIR, never None (None starts a fresh run)."""
    eng = FakeEngine()
    eng.save_checkpoint(tmp_path, "step_000004.tmp", save_latest=False)
    (tmp_path / "step_000005").mkdir()
    (tmp_path / "latest").write_text("step_000005\n")
    with pytest.raises(FileNotFoundError, match="no complete checkpoint in that folder") as info:
        ckpt.resolve_resume(str(tmp_path), tmp_path / "unused")
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)
    assert ckpt.resolve_resume("auto", tmp_path) is None  # auto: nothing to resume is a fresh start


def test_crash_between_rename_and_pointer(tmp_path):
    eng = FakeEngine()
    _save(eng, tmp_path, 2)
    _save(eng, tmp_path, 4)
    (tmp_path / "latest").write_text("step_000002\n")  # as if killed before os.replace(latest)
    assert ckpt.find_checkpoint(tmp_path).name == "step_000004"
    (tmp_path / "latest").write_text("step_000009\n")  # pointer to something gone
    assert ckpt.find_checkpoint(tmp_path).name == "step_000004"
    assert ckpt.resolve_resume("auto", tmp_path / "nothing_here") is None


def test_disk_full_messages_name_what_is_on_disk(tmp_path, monkeypatch):
    """ENOSPC before the rename: 'not written', the previous one named; on the pointer only: the
    new checkpoint is complete and found by the scan, and the message says so."""
    import errno

    eng = FakeEngine()
    _save(eng, tmp_path, 2)

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "write_json", full)
    with pytest.raises(ckpt.CheckpointWriteError, match="step_000004 was not written .*step_000002 .intact"):
        _save(eng, tmp_path, 4)
    assert not (tmp_path / "step_000004.tmp").exists() and ckpt.find_checkpoint(tmp_path).name == "step_000002"
    monkeypatch.undo()
    monkeypatch.setattr(ckpt, "atomic_write_text", full)
    with pytest.raises(ckpt.CheckpointWriteError, match="step_000004 was written but the 'latest' pointer"):
        _save(eng, tmp_path, 4)
    assert (tmp_path / "latest").read_text().strip() == "step_000002"
    assert ckpt.find_checkpoint(tmp_path).name == "step_000004"


def test_rng_state_is_json_and_round_trips():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = json.loads(json.dumps(ckpt.rng_state()))  # plain JSON, no pickle
    a = (random.random(), np.random.rand(), torch.rand(3))
    ckpt.set_rng_state(state)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


class _RngAtFitStart(Callback):
    """Records the global RNG states when ``fit`` starts (after the trainer built everything and resumed)."""

    def __init__(self):
        self.state = None

    def on_fit_start(self, trainer) -> None:
        self.state = ckpt.rng_state()


def test_resume_restores_the_rng_states(tmp_path):
    """A resumed run starts ``fit`` with the RNG states (python, numpy, torch) its rank saved in the
    checkpoint, and its first step equals the uninterrupted run's bit for bit: the chunker's boundary
    noise draws from the global torch RNG, so a resume that does not restore it takes another step."""
    raw = helpers.config(tmp_path, name="whole", train={"max_steps": 3}, checkpoint={"every_steps": 2})
    helpers.run_inprocess(raw, tmp_path)
    saved = tmp_path / "whole" / "ckpt" / "step_000002"
    at_start = _RngAtFitStart()
    resumed = helpers.run_inprocess({**raw, "name": "resumed"}, tmp_path, resume=str(saved),
                                    extra_callbacks=[at_start])
    assert resumed.resumed_from == str(saved)
    rng = json.loads((saved / ckpt.rank_file(0)).read_text())["rng"]
    for kind in ("python", "numpy", "torch"):
        assert at_start.state[kind] == rng[kind], f"the {kind} RNG state is not the checkpoint's after resume"
    whole, again = helpers.records(tmp_path / "whole")[2], helpers.records(tmp_path / "resumed")[0]
    assert whole["step"] == again["step"] == 3
    assert (again["loss"], again["grad_norm"]) == (whole["loss"], whole["grad_norm"])


@pytest.mark.integration  # launches vlm.train
def test_kill_during_save_then_resume_auto(tmp_path):
    """kill -9 in the middle of the step-4 save: step 2 stays the loadable newest checkpoint;
    ``--resume auto`` picks it and the resumed steps 3-4 reproduce the killed run's losses."""
    raw = helpers.config(tmp_path, name="crash", train={"max_steps": 6},
                         checkpoint={"every_steps": 2, "keep_last": 2})
    cfg_path = helpers.write_config(tmp_path, raw)
    run_dir = tmp_path / "crash"
    proc = helpers.launch(cfg_path, launcher="python", timeout=240,
                          env=helpers.clean_env(VLM_TRAIN_FAULT="kill_during_save:4"))
    assert proc.returncode == -9, proc.stdout[-3000:]
    ck = run_dir / "ckpt"
    assert (ck / "step_000004.tmp").is_dir() and not (ck / "step_000004").exists()
    assert (ck / "latest").read_text().strip() == "step_000002"
    assert ckpt.find_checkpoint(ck).name == "step_000002"
    before = helpers.losses(run_dir)
    assert sorted(before) == [1, 2, 3, 4]
    trainer = helpers.run_inprocess(raw, tmp_path, resume="auto")
    assert trainer.resumed_from.endswith("step_000002")
    recs = helpers.records(run_dir)
    resumed = {r["step"]: r["loss"] for r in recs[4:]}
    assert sorted(resumed) == [3, 4, 5, 6]
    # (the killed run had 1 thread, this process may have more: equal up to summation order)
    assert resumed[3] == pytest.approx(before[3], abs=1e-5) and resumed[4] == pytest.approx(before[4], abs=1e-5)
    assert [p.name for p in ckpt.list_checkpoints(ck)] == ["step_000004", "step_000006"]
    assert not (ck / "step_000004.tmp").exists()


def test_a_checkpoint_from_before_the_fused_expert_weight_is_refused(tmp_path):
    """A checkpoint whose trainer_state.json has no ``expert_layout`` (written while the experts' gate and
    up were two parameters) is refused on resume with one line: DeepSpeed would load its flat
    optimizer partitions, same total size, into the new parameter order without an error. The same
    checkpoint with the field resumes."""
    raw = helpers.config(tmp_path, name="layout", train={"max_steps": 2}, checkpoint={"every_steps": 2})
    helpers.run_inprocess(raw, tmp_path)
    state_file = tmp_path / "layout" / "ckpt" / "step_000002" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state["expert_layout"] == "w_gate_up"
    del state["expert_layout"]
    state_file.write_text(json.dumps(state))
    with pytest.raises(ckpt.ResumeError) as err:
        helpers.run_inprocess({**raw, "train": {**raw["train"], "max_steps": 3}}, tmp_path, resume="auto")
    msg = str(err.value)
    assert "\n" not in msg and "before the experts' gate and up were one parameter" in msg, msg
