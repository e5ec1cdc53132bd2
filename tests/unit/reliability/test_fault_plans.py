"""The ``Faults`` object of the reliability suite (vlm/reliability/faults.py): the spec parses to named
points, a fault fires only at its point, step and rank, and a plan enters through the reliability entry
point only. The suite's runs (kill -9, full disk, a dead rank) are in tests/integration/reliability."""
from __future__ import annotations

import errno
import signal

import pytest
import torch

from vlm.reliability.faults import (
    ENV,
    NO_FAULTS,
    POINTS,
    Fault,
    Faults,
    FaultSpecError,
    parse,
)


def test_fault_spec_parses_to_named_points():
    assert parse("kill:before_rename:10, enospc:engine:10:1,nan:loss:3") == [
        Fault("ckpt.before_rename", 10, 0), Fault("ckpt.engine", 10, 1), Fault("train.loss", 3, 0)]
    assert parse("kill_during_save:4") == [Fault("ckpt.before_state", 4, 0)]  # old spelling
    assert parse(None) == parse("") == []
    for bad in ("kill:nowhere:3", "enospc:before_rename:3", "kill:after_save", "kill:after_save:x", "nan:loss:1:2:3"):
        with pytest.raises(FaultSpecError, match=ENV):
            parse(bad)
    with pytest.raises(FaultSpecError, match="unknown fault point"):
        Faults([Fault("ckpt.typo", 1)])


def test_faults_fire_only_at_their_point_step_and_rank(tmp_path, monkeypatch):
    kills = []
    monkeypatch.setattr("os.kill", lambda pid, sig: kills.append(sig))
    faults = Faults.from_env({ENV: "kill:after_save:4:1,enospc:latest:4,nan:loss:2"})
    faults.at("ckpt.after_save", 4, 0)   # wrong rank
    faults.at("ckpt.after_save", 3, 1)   # wrong step
    assert kills == []
    faults.at("ckpt.after_save", 4, 1)
    assert kills == [signal.SIGKILL]
    with pytest.raises(OSError) as err:
        faults.at("ckpt.latest", 4, 0, tmp_path / "latest.tmp")
    assert err.value.errno == errno.ENOSPC and "latest.tmp" in str(err.value)
    with pytest.raises(KeyError, match="no fault point"):
        faults.at("ckpt.before_renmae", 4, 0)  # a misspelt point is an error, not a silent no-op
    one = torch.tensor(1.0)
    assert faults.loss(one, 1, 0) is one
    assert torch.isnan(faults.loss(one, 2, 0)) and faults.loss(one, 2, 1) is one  # rank 0 unless one is named
    assert not NO_FAULTS and faults and set(POINTS) >= {f.point for f in faults.faults}


def test_fault_plans_enter_through_the_reliability_entry_point_only(tmp_path, monkeypatch, capsys):
    """``python -m vlm.train`` refuses a fault plan (one line, exit 2) instead of ignoring it;
    ``python -m vlm.reliability.train`` reads it, and a malformed one is one line, exit 2."""
    from vlm.reliability.runs import config, write_config
    from vlm.reliability.train import main as faulty_main
    from vlm.train import main

    path = write_config(tmp_path, config(tmp_path, name="plan"), "plan.yaml")
    monkeypatch.setenv(ENV, "nan:loss:1")
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "python -m vlm.reliability.train" in err, err
    monkeypatch.setenv(ENV, "kill:nowhere:3")
    assert faulty_main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {ENV}: bad fault 'kill:nowhere:3'") and len(err.splitlines()) == 1, err
