"""Fault injection: the reliability suite's CI subset (`make faults` runs all of it, see vlm/reliability/;
the ``Faults`` object's own tests are in tests/unit/reliability/test_fault_plans.py): one uninterrupted
2-process ZeRO-2 run is the reference; each case injects a failure into the same run, resumes with
--resume auto and must end on the reference's parameters exactly."""
from __future__ import annotations

import pytest

from vlm.reliability import cases
from vlm.reliability.harness import TOL
from vlm.reliability.soak import run_soak
from vlm.config.train import REPO_ROOT


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def reference(work):
    return cases.reference(work)


def _passed(trial):
    assert trial.ok, f"{trial.case}: {trial.detail}"
    assert trial.param_diff is not None and trial.param_diff <= TOL


def test_kill9_random_step_resumes_to_the_same_weights(work, reference):
    _passed(cases.kill9(work, reference, trial=0, seed=0))


def test_kill9_inside_checkpoint_write_keeps_the_previous_one(work, reference):
    trial = cases.kill_in_save(work, reference, "after_engine")
    _passed(trial)
    assert trial.redone_steps == cases.SAVE_STEP - 5  # back to step 5, steps 6-10 redone


def test_disk_full_on_one_rank_fails_cleanly_on_all(work, reference):
    _passed(cases.enospc(work, reference, "engine", rank=1))


def test_dead_rank_is_reported_not_a_hang(work, reference):
    _passed(cases.rank_death(work, reference, "dies"))


@pytest.mark.skipif(not (REPO_ROOT / "data/default/.built").is_file(), reason="default data not built (make data)")
def test_short_soak(work):
    res = run_soak(work, steps=200, ckpt_every=40, log_every=20)
    assert res.ok, res.detail
