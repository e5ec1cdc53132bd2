"""More CPU ranks than cores (issue 39: `deepspeed --num_gpus 8` on a machine without GPUs started 8 CPU
ranks on 2 cores without a word): rank 0 says so in one line at the start; on CUDA, or with as many
cores as ranks, nothing is said."""
from __future__ import annotations

import os

import _train_helpers as helpers

from vlm.training.distributed import local_world_size, oversubscribed


def test_the_ranks_on_this_machine_are_read_from_each_launcher():
    assert local_world_size({"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"}) == 4  # torchrun
    assert local_world_size({"LOCAL_SIZE": "8", "WORLD_SIZE": "16"}) == 8  # the deepspeed launcher
    assert local_world_size({"WORLD_SIZE": "3"}) == 3
    assert local_world_size({}) == 1


def test_the_warning_only_where_cpu_ranks_outnumber_cores():
    line = oversubscribed("cpu", 8, 2)
    assert line.startswith("[train] warning: 8 CPU ranks on this machine, which has 2 cores") and "\n" not in line
    assert oversubscribed("cpu", 2, 2) is None
    assert oversubscribed("cuda", 8, 2) is None


def test_a_run_under_the_deepspeed_launchers_env_says_it_once(tmp_path, monkeypatch, capsys):
    """The deepspeed launcher's environment (LOCAL_SIZE) naming more local ranks than this machine has cores:
    the run's log has the warning line once (this process is rank 0)."""
    cores = os.cpu_count() or 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # set by earlier in-process runs
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_SIZE": str(cores + 1),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ.get("MASTER_PORT", "29533")}.items():
        monkeypatch.setenv(key, value)
    raw = helpers.config(tmp_path, name="ranks", device="cpu", train={"max_steps": 1},
                         checkpoint={"every_steps": 0, "save_final": False})
    helpers.run_inprocess(raw, tmp_path)
    out = capsys.readouterr().out.splitlines()
    warnings = [line for line in out if "CPU ranks on this machine" in line]
    assert warnings == [f"[train] warning: {cores + 1} CPU ranks on this machine, which has {cores} cores: they share "
                        "them (slower than fewer ranks); --num_gpus / --nproc_per_node start that many ranks also "
                        "where there is no GPU"], out
