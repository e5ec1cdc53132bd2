"""Where ``make bench`` writes (issue 39: it rewrote 26 tracked files under benchmarks/results/ with figures
measured under load): runs/bench/ by default, benchmarks/results/ (the recorded figures) only with
``make bench RECORD=1`` / ``--record``; each benchmark script the same."""
from __future__ import annotations

import os
import subprocess

import pytest

from benchmarks import ROOT, cli, run_all


def _run_all_out(monkeypatch, argv) -> list:
    """The folder ``run_all.main(argv)`` writes to (no benchmark run: ``--only`` names none)."""
    seen = []
    monkeypatch.setattr(run_all, "write_summary", lambda out, *a, **k: seen.append(out))
    run_all.main(["--only", "", *argv])
    return seen


def test_run_all_writes_runs_bench_unless_asked_to_record(monkeypatch, tmp_path):
    assert (cli.SCRATCH, cli.RESULTS) == (ROOT / "runs" / "bench", ROOT / "benchmarks" / "results")
    # the two folders moved under tmp_path: run_all creates the one it writes to
    monkeypatch.setattr(cli, "SCRATCH", tmp_path / "scratch")
    monkeypatch.setattr(cli, "RESULTS", tmp_path / "recorded")
    assert _run_all_out(monkeypatch, []) == [tmp_path / "scratch"]
    assert _run_all_out(monkeypatch, ["--record"]) == [tmp_path / "recorded"]
    assert _run_all_out(monkeypatch, ["--out", str(tmp_path / "x")]) == [tmp_path / "x"]


def test_each_benchmark_script_the_same():
    ap = cli.base_parser("prefill", "doc", "lengths")
    assert cli.out_dir(ap.parse_args([])) == ROOT / "runs" / "bench"
    assert cli.out_dir(ap.parse_args(["--record"])) == ROOT / "benchmarks" / "results"
    with pytest.raises(SystemExit, match="--out DIR or --record, not both"):
        cli.out_dir(ap.parse_args(["--record", "--out", "x"]))


@pytest.mark.parametrize("words, record", [([], False), (["RECORD=1"], True)])
def test_make_bench_records_only_when_asked(words, record):
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "RECORD")}
    out = subprocess.run(["make", "-n", "-s", "-C", str(ROOT), "bench", "DATA_STAMP=", *words], capture_output=True,
                         text=True, check=True, env=env, timeout=60).stdout
    line = next(ln for ln in out.splitlines() if "-m benchmarks.run_all" in ln)
    assert ("--record" in line.split()) == record, line
