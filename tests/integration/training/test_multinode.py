"""A simulated 2-node run (scripts/simulate_2node.py): two torchrun invocations with
``--nnodes 2 --node_rank 0|1 --master_addr 127.0.0.1``, one CPU process each (gloo), train the tiny
VLM; node 1 is killed whole (launcher + worker, SIGKILL) after the step-5 checkpoint; node 0 must
exit on its own with one error line; both nodes resume with ``--resume auto`` and the losses and
final parameters must equal an uninterrupted 2-node run's."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from vlm.config.train import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "simulate_2node.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("simulate_2node", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


sim = _load_script()


def test_node_commands_are_the_multinode_forms(tmp_path):
    cfg, hostfile = tmp_path / "c.yaml", tmp_path / "hostfile"
    for rank in (0, 1):
        tr = sim.shown(sim.node_command("torchrun", rank, 29500, cfg, hostfile, ["--resume", "auto"]))
        assert tr.startswith(f"torchrun --nnodes 2 --node_rank {rank} --nproc_per_node 1 --master_addr 127.0.0.1 "
                             "--master_port 29500 -m vlm.train --config ")
        assert tr.endswith("--no-eval --resume auto")
        ds = sim.shown(sim.node_command("deepspeed", rank, 29500, cfg, hostfile, []))
        assert ds.startswith(f"deepspeed --hostfile {hostfile} --no_ssh --node_rank {rank} --master_addr 127.0.0.1 "
                             "--master_port 29500 --module vlm.train --config ")
    with pytest.raises(ValueError, match="launcher 'mpirun'"):
        sim.node_command("mpirun", 0, 29500, cfg, hostfile, [])
    with pytest.raises(ValueError, match="ckpt_every < kill_after < steps"):
        sim.simulate(tmp_path, steps=6, ckpt_every=5, kill_after=5)


@pytest.mark.slow
def test_two_nodes_killed_and_resumed_match_the_uninterrupted_run(tmp_path: Path):
    result = sim.simulate(tmp_path, launcher="torchrun", steps=12, ckpt_every=5, kill_after=6, dist_timeout_s=30)
    report = sim.report(result)
    print(report)
    names = [c.name for c in result.checks]
    assert names == ["reference run", "both nodes joined one world of size 2",
                     "node 1 killed mid-run (SIGKILL to its launcher and worker)",
                     "node 0 exits on its own with one clear line",
                     "resumed from the newest checkpoint and ran to the end",
                     "losses equal the uninterrupted run", "final parameters equal the uninterrupted run"], report
    assert result.ok, "\n".join(result.failed()) + "\n" + report
    # the numbers behind the checks, stated here as well
    assert sorted(result.reference) == list(range(1, 13))
    killed_at = max(result.killed)
    assert 6 <= killed_at < 12 and min(result.resumed) in (6, 11)  # from step_000005 (or step_000010)
    combined = {**result.killed, **result.resumed}
    assert max(abs(combined[s] - result.reference[s]) for s in range(1, 13)) <= sim.TOL
    assert "error: rank 0: lost the other ranks" in report
