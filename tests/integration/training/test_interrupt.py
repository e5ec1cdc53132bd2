"""Ctrl-C under torchrun (issue 33: three tracebacks, no word of what to do next): the terminal's SIGINT
reaches torchrun, which passes it to each rank; each rank says in one line where it stopped and which
checkpoint ``--resume auto`` takes up. torchrun's own traceback of the signal is torchrun's."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import _train_helpers as helpers

from vlm.training import checkpoint as ckpt

LINE = re.compile(r"^rank (\d): interrupted at step (\d+); newest checkpoint (\S+): rerun with --resume auto$")


def test_ctrl_c_under_torchrun_is_one_line_per_rank(tmp_path):
    raw = helpers.config(tmp_path, name="ctrl-c", train={"max_steps": 10_000}, checkpoint={"every_steps": 2})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "vlm.train",
           "--config", str(helpers.write_config(tmp_path, raw))]
    proc = subprocess.Popen(cmd, cwd=helpers.REPO_ROOT, env=helpers.clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    ck = tmp_path / "ctrl-c" / "ckpt"
    try:
        deadline = time.time() + 240
        while ckpt.find_checkpoint(ck) is None and proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the launcher's process group
        out, _ = proc.communicate(timeout=120)
    finally:
        helpers.kill_tree(proc.pid)
    lines = [m for m in map(LINE.match, out.splitlines()) if m]
    assert sorted(int(m.group(1)) for m in lines) == [0, 1], out[-4000:]
    assert not [line for line in out.splitlines() if line.startswith("[rank")], out[-4000:]  # no rank traceback
    assert out.count("Traceback") <= 1, out[-4000:]  # torchrun's own, at most
    newest = ckpt.find_checkpoint(ck)
    assert {m.group(3) for m in lines} == {str(newest)}
    assert all(int(m.group(2)) >= ckpt._step_of(newest) for m in lines)
