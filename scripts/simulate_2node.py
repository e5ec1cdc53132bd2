"""A simulated 2-node run on one machine: two launcher invocations ("nodes") with one CPU process
each (gloo), joined through ``--master_addr 127.0.0.1``, the way a user starts a job on two nodes
with ``--node_rank 0`` / ``--node_rank 1``. The run is killed and resumed:

1. reference: both nodes train the tiny VLM for ``--steps`` steps, uninterrupted;
2. killed: the same run again; once rank 0 has logged step ``--kill-after`` (after the step-5
   checkpoint), node 1 is killed whole (SIGKILL to its launcher and its worker, as when a machine
   dies). Node 0 must exit on its own within ``dist_timeout_s`` + 30 s with one
   ``error: rank 0: lost the other ranks ...`` line (trainer exit 4), not hang;
3. resumed: both nodes are relaunched with ``--resume auto`` and train to the end.

Checks (each printed as one line; exit 1 if any fails): both nodes joined one world of size 2; the
kill landed mid-run; node 0 exited with the one error line; the resumed run started right after the
newest complete checkpoint; every step's loss of killed + resumed equals the reference's (max
|diff| <= 1e-6, fp32), and so do the final parameters.

    .venv/bin/python scripts/simulate_2node.py                        # torchrun, work dir runs/simulate_2node
    .venv/bin/python scripts/simulate_2node.py --launcher deepspeed   # deepspeed, hostfile of 2 "hosts", --no_ssh

Launchers. ``torchrun --nnodes 2 --node_rank K --nproc_per_node 1 --master_addr 127.0.0.1
--master_port P -m vlm.train ...`` on each node. ``deepspeed --hostfile H --no_ssh --node_rank K
--master_addr 127.0.0.1 --master_port P --module vlm.train ...`` on each node, H listing two hosts
(``node0 slots=1``, ``node1 slots=1``): with ``--no_ssh`` DeepSpeed's runner starts only this
node's processes (its local launcher with ``--node_rank``) and needs neither ssh nor pdsh; without
it, a hostfile of more than one host makes the runner check passwordless ssh to the first host and
start every node through pdsh from one machine. The per-node logs, configs and run folders are left
in the work dir."""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from vlm.reliability import runs
from vlm.training import checkpoint as ckpt
from torch.distributed.elastic.utils.distributed import get_free_port

NODES = 2
TOL = 1e-6               # fp32 on CPU: the resumed run must reproduce the reference to this
EXIT_GRACE_S = 30        # node 0 must exit within dist_timeout_s + this after node 1 dies
LOST_PEER = "error: rank 0: lost the other ranks"
LAUNCHERS = ("torchrun", "deepspeed")


def node_command(launcher: str, node_rank: int, port: int, config: Path, hostfile: Path,
                 extra: list[str]) -> list[str]:
    """The command one "node" runs (``python -m`` the launcher so it is this venv's)."""
    py = sys.executable
    if launcher == "torchrun":
        head = [py, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--node_rank", str(node_rank),
                "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "vlm.train"]
    elif launcher == "deepspeed":
        head = [py, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh", "--node_rank",
                str(node_rank), "--master_addr", "127.0.0.1", "--master_port", str(port), "--module", "vlm.train"]
    else:
        raise ValueError(f"launcher {launcher!r}: expected one of {LAUNCHERS}")
    return head + ["--config", str(config), "--no-eval", *extra]


def shown(cmd: list[str]) -> str:
    """The command as a user would type it (the launcher's console script, repo-relative paths)."""
    text = " ".join(cmd).replace(f"{sys.executable} -m torch.distributed.run", "torchrun")
    text = text.replace(f"{sys.executable} -m deepspeed.launcher.runner", "deepspeed")
    return text.replace(str(ROOT) + "/", "")


class Node:
    """One launcher invocation in a session of its own (a machine of its own, as far as signals go),
    its output in ``log``."""

    def __init__(self, cmd: list[str], log: Path, env: dict):
        self.cmd, self.log = cmd, log
        with open(log, "w", encoding="utf-8") as f:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self, launcher_only: bool = False) -> list[psutil.Process]:
        """SIGKILL the launcher and every process it started (listed first: once the launcher is
        gone its workers are re-parented and no longer found under it), or with ``launcher_only``
        the launcher alone. Returns the processes it started (alive or not)."""
        try:
            launcher = psutil.Process(self.proc.pid)
            tree = launcher.children(recursive=True)
        except psutil.NoSuchProcess:
            launcher, tree = None, []
        for p in [launcher] if launcher_only else [launcher, *tree]:
            try:
                if p is not None:
                    p.kill()  # psutil checks the pid still names the same process
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()
        return tree

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.is_file() else ""


@dataclass
class Phase:
    """Both nodes of one launch."""
    name: str
    nodes: list[Node]

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc.poll() is None:
                node.kill()


@dataclass
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"[{'PASS' if self.ok else 'FAIL'}] {self.name}: {self.detail}"


@dataclass
class Result:
    launcher: str
    work: Path
    checks: list[Check] = field(default_factory=list)
    commands: dict[str, list[str]] = field(default_factory=dict)   # phase -> the two node commands
    logs: dict[str, list[Path]] = field(default_factory=dict)      # phase -> the two node logs
    reference: dict[int, float] = field(default_factory=dict)      # step -> loss
    killed: dict[int, float] = field(default_factory=dict)
    resumed: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def check(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append(Check(name, bool(ok), detail))
        return bool(ok)

    def failed(self) -> list[str]:
        return [c.line() for c in self.checks if not c.ok]


def write_config(work: Path, name: str, steps: int, ckpt_every: int, dist_timeout_s: int) -> Path:
    """The reliability suite's tiny VLM (synthetic data, fp32, ZeRO-2) for ``steps`` steps."""
    raw = runs.config(work, base=runs.TINY_VLM, name=name, deepspeed="zero2", dist_timeout_s=dist_timeout_s,
                      train={"max_steps": steps, "micro_batch_size": 4, "grad_accum": 1},
                      log={"every_steps": 1, "progress_bar": False, "tensorboard": False},
                      checkpoint={"every_steps": ckpt_every, "keep_last": 3, "export_hf": False},
                      eval={"vqa_json": None})
    return runs.write_config(work, raw, f"{name}.yaml")


def launch(result: Result, phase: str, config: Path, extra: list[str] = ()) -> Phase:
    work, port = result.work, get_free_port()
    hostfile = work / "hostfile"
    # torchrun's agents log the rendezvous result (group_rank / group_world_size) at INFO
    env = runs.clean_env(**({"LOGLEVEL": "INFO"} if result.launcher == "torchrun" else {}))
    nodes, cmds, logs = [], [], []
    for rank in range(NODES):
        cmd = node_command(result.launcher, rank, port, config, hostfile, list(extra))
        log = work / f"{phase}.node{rank}.log"
        nodes.append(Node(cmd, log, env))
        cmds.append(cmd)
        logs.append(log)
    result.commands[phase], result.logs[phase] = cmds, logs
    return Phase(phase, nodes)


def losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of every training record, in the order written (a resumed run appends)."""
    return [(int(r["step"]), float(r["loss"])) for r in runs.live_records(run_dir)]


def wait_all(phase: Phase, timeout: float) -> list[int | None]:
    end = time.monotonic() + timeout
    return [node.wait(max(0.1, end - time.monotonic())) for node in phase.nodes]


def wait_for_step(phase: Phase, run_dir: Path, step: int, timeout: float) -> bool:
    """Block until rank 0 has logged ``step``; False if a node exited first or time ran out."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done = losses(run_dir)
        if done and done[-1][0] >= step:
            return all(n.proc.poll() is None for n in phase.nodes)
        if any(n.proc.poll() is not None for n in phase.nodes):
            return False
        time.sleep(0.02)
    return False


def joined(result: Result, phase: str, run_dir: Path, step: int) -> tuple[bool, str]:
    """Evidence that the two nodes formed one world of size 2: rank 0's start line, node 1's
    launcher (its rendezvous result / world info), and rank 1's own file in the step-``step``
    checkpoint (written by that process: its rank and the world size)."""
    log0, log1 = (p.read_text(errors="replace") for p in result.logs[phase])
    start = re.search(r"\[train\] run .*world size (\d+)", log0)
    if result.launcher == "torchrun":
        launcher_ok = re.search(r"group_rank=1\b", log1) and re.search(r"group_world_size=2\b", log1)
        launcher_says = "node 1's torchrun: group_rank=1 group_world_size=2"
    else:
        launcher_ok = "node_rank=1" in log1 and "dist_world_size=2" in log1
        launcher_says = "node 1's deepspeed launcher: node_rank=1 dist_world_size=2"
    rank_file = run_dir / "ckpt" / ckpt.step_dir_name(step) / ckpt.rank_file(1)
    rank1 = json.loads(rank_file.read_text()) if rank_file.is_file() else {}
    ok = (start and start.group(1) == "2" and launcher_ok and rank1.get("rank") == 1
          and rank1.get("data", {}).get("world_size") == 2)
    detail = (f"rank 0 log: 'world size {start.group(1) if start else '?'}'; "
              f"{launcher_says if launcher_ok else 'node 1 launcher: no rendezvous line'}; "
              f"{rank_file.parent.name}/{rank_file.name}: rank {rank1.get('rank')}, "
              f"world size {rank1.get('data', {}).get('world_size')}")
    return bool(ok), detail


def max_param_diff(a: Path, b: Path) -> float:
    """max |a - b| over the model parameters of two checkpoints (DeepSpeed's model-states file)."""
    import torch

    name = "mp_rank_00_model_states.pt"
    sa = torch.load(a / name, map_location="cpu", weights_only=True)["module"]
    sb = torch.load(b / name, map_location="cpu", weights_only=True)["module"]
    if sa.keys() != sb.keys():
        return float("inf")
    return max((float((sa[k].float() - sb[k].float()).abs().max()) for k in sa if sa[k].numel()), default=0.0)


def simulate(work: Path, launcher: str = "torchrun", steps: int = 12, ckpt_every: int = 5, kill_after: int = 6,
             dist_timeout_s: int = 30, run_timeout_s: float = 300.0) -> Result:
    """Run the three phases under ``work`` and return the checks. The run folders and node logs of
    an earlier simulation in ``work`` are removed first (a resumed run appends to metrics.jsonl)."""
    if not ckpt_every < kill_after < steps:
        raise ValueError(f"need ckpt_every < kill_after < steps, got {ckpt_every}, {kill_after}, {steps}")
    work = Path(work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    for old in [work / "reference", work / "run", *work.glob("*.node[0-9].log")]:
        if old.is_dir():
            shutil.rmtree(old)
        elif old.exists():
            old.unlink()
    (work / "hostfile").write_text("".join(f"node{i} slots=1\n" for i in range(NODES)))
    result = Result(launcher, work)
    t0 = time.monotonic()
    ref_cfg = write_config(work, "reference", steps, ckpt_every, dist_timeout_s)
    run_cfg = write_config(work, "run", steps, ckpt_every, dist_timeout_s)
    ref_dir, run_dir = work / "reference", work / "run"

    # 1. the uninterrupted reference
    phase = launch(result, "reference", ref_cfg)
    try:
        rcs = wait_all(phase, run_timeout_s)
    finally:
        phase.stop()
    result.reference = dict(losses(ref_dir))
    if not result.check("reference run", rcs == [0, 0] and sorted(result.reference) == list(range(1, steps + 1)),
                        f"node exit codes {rcs}, steps {min(result.reference, default=None)}.."
                        f"{max(result.reference, default=None)}"):
        result.seconds = time.monotonic() - t0
        return result
    result.check("both nodes joined one world of size 2", *joined(result, "reference", ref_dir, ckpt_every))

    # 2. the same run; node 1 dies (launcher + worker, SIGKILL) once rank 0 logged step kill_after
    phase = launch(result, "killed", run_cfg)
    node0, node1 = phase.nodes
    try:
        alive = wait_for_step(phase, run_dir, kill_after, run_timeout_s)
        hit = [p.pid for p in node1.kill()] if alive else []
        t_kill = time.monotonic()
        rc0 = node0.wait(dist_timeout_s + EXIT_GRACE_S)
        waited = time.monotonic() - t_kill
    finally:
        phase.stop()
    before = losses(run_dir)
    result.killed = dict(before)
    killed_at = before[-1][0] if before else 0
    newest = ckpt.find_checkpoint(run_dir / "ckpt")
    newest_step = int(newest.name.split("_")[1]) if newest else 0
    if not result.check("node 1 killed mid-run (SIGKILL to its launcher and worker)",
                        alive and kill_after <= killed_at < steps and newest_step >= ckpt_every,
                        f"launcher pid {node1.proc.pid} + pids {hit} under it killed after rank 0 logged step "
                        f"{killed_at}/{steps}; newest complete "
                        f"checkpoint {newest.name if newest else None}" if alive else
                        f"a node exited before step {kill_after} was logged: "
                        f"{[n.proc.returncode for n in phase.nodes]}"):
        result.seconds = time.monotonic() - t0
        return result
    log0 = node0.text()
    lines = [ln for ln in log0.splitlines() if ln.startswith(LOST_PEER)]
    bound = dist_timeout_s + EXIT_GRACE_S
    result.check("node 0 exits on its own with one clear line", rc0 not in (None, 0) and len(lines) == 1,
                 f"node 0 launcher exit {rc0} {waited:.1f} s after the kill (bound {bound} s); "
                 f"{len(lines)} line(s): {lines[0] if lines else log0.strip().splitlines()[-1:]}")

    # 3. both nodes again, --resume auto
    phase = launch(result, "resumed", run_cfg, ["--resume", "auto"])
    try:
        rcs = wait_all(phase, run_timeout_s)
    finally:
        phase.stop()
    after = losses(run_dir)[len(before):]
    result.resumed = dict(after)
    log0 = result.logs["resumed"][0].read_text(errors="replace")
    resumed_line = re.search(r"\[train\] resumed from (\S+)", log0)
    steps_after = [s for s, _ in after]
    result.check("resumed from the newest checkpoint and ran to the end",
                 rcs == [0, 0] and resumed_line is not None and resumed_line.group(1).endswith(newest.name)
                 and steps_after == list(range(newest_step + 1, steps + 1)),
                 f"node exit codes {rcs}; '{resumed_line.group(0) if resumed_line else 'no resumed line'}'; "
                 f"steps {steps_after[:1]}..{steps_after[-1:]}")
    combined = {**result.killed, **result.resumed}
    diffs = {s: abs(combined[s] - result.reference[s]) for s in combined if s in result.reference}
    redone = [s for s in result.resumed if s in result.killed]
    worst = max(diffs.values(), default=float("inf"))
    result.check("losses equal the uninterrupted run",
                 sorted(diffs) == list(range(1, steps + 1)) and worst <= TOL,
                 f"max |loss - reference| {worst:.1e} over steps 1..{steps} (tol {TOL:.0e}); "
                 f"steps {redone} were lost with node 1 and redone")
    final = ckpt.step_dir_name(steps)
    try:
        pdiff = max_param_diff(ref_dir / "ckpt" / final, run_dir / "ckpt" / final)
    except FileNotFoundError as err:
        pdiff, why = float("inf"), f"missing {err.filename}"
    else:
        why = f"max |param - reference| {pdiff:.1e} at {final}"
    result.check("final parameters equal the uninterrupted run", pdiff <= TOL, why)
    result.seconds = time.monotonic() - t0
    return result


def launcher_death(work: Path, launcher: str = "torchrun", steps: int = 12, ckpt_every: int = 5,
                   kill_after: int = 6, dist_timeout_s: int = 30, wait_s: float = 420.0) -> Result:
    """Only node 1's launcher dies (SIGKILL to the launcher process; its worker lives on, re-parented):
    what node 0 does. Reported, not judged against a fixed expectation beyond "node 0 exits within
    ``wait_s``" (no endless hang): the orphaned worker is still a member of the world, so training
    goes on; what node 0's launcher does at the end is the launcher's own business (torchrun's agent
    waits for node 1's agent in its exit barrier)."""
    work = Path(work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    (work / "hostfile").write_text("".join(f"node{i} slots=1\n" for i in range(NODES)))
    run_dir = work / "launcher_death"
    for old in [run_dir, *work.glob("launcher_death.node[0-9].log")]:
        if old.is_dir():
            shutil.rmtree(old)
        elif old.exists():
            old.unlink()
    result = Result(launcher, work)
    t0 = time.monotonic()
    cfg = write_config(work, "launcher_death", steps, ckpt_every, dist_timeout_s)
    phase = launch(result, "launcher_death", cfg)
    node0, node1 = phase.nodes
    orphans: list[psutil.Process] = []
    try:
        alive = wait_for_step(phase, run_dir, kill_after, 300.0)
        orphans = node1.kill(launcher_only=True) if alive else []
        t_kill = time.monotonic()
        at_kill = losses(run_dir)[-1][0] if alive else 0
        rc0 = node0.wait(wait_s)
        waited, t_exit = time.monotonic() - t_kill, time.time()
        _, still = psutil.wait_procs(orphans, timeout=5)
    finally:
        phase.stop()
        for p in orphans:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    done = losses(run_dir)
    last = done[-1][0] if done else 0
    t_end = (run_dir / "metrics.jsonl").stat().st_mtime if done else None
    log0 = node0.text()
    errors = [GLOG_PREFIX.sub("", ln).strip() for ln in log0.splitlines()
              if ln.startswith("error:") or "Error waiting on exit barrier" in ln][:2]
    result.check("node 1's launcher killed alone mid-run", alive,
                 f"launcher pid {node1.proc.pid} killed after step {at_kill}/{steps}; its worker(s) "
                 f"{[p.pid for p in orphans]} left running")
    result.check("node 0 exits (no endless hang)", rc0 is not None,
                 f"node 0 launcher exit {rc0} {waited:.0f} s after the kill; training reached step {last}/{steps}"
                 f"{f' ({t_exit - t_end:.0f} s before node 0 exited)' if t_end else ''}; orphaned worker(s) "
                 f"{'exited' if not still else 'still running (killed now)'}; node 0 errors: {errors or 'none'}")
    result.seconds = time.monotonic() - t0
    return result


GLOG_PREFIX = re.compile(r"^[IWE]\d{4} [^]]*\] *")  # torch's "I1203 17:21:39.456 pid file:line] "


def log_tail(path: Path, keep: str, n: int) -> list[str]:
    """The last ``n`` lines of a node log that match ``keep`` (the launchers' own chatter is long)."""
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return [ln.strip() for ln in lines if re.search(keep, ln)][-n:]


def report(result: Result) -> str:
    """The commands of every phase, a tail of each node's log, the checks."""
    if result.launcher == "torchrun":
        keep0, keep1 = r"^\[train\] (run|step|checkpoint|resumed)|^error:|exitcode|exit barrier", r"group_rank=|group_world_size="
    else:
        keep0 = r"^\[train\] (run|step|checkpoint|resumed)|^error:|launch\.py.*(exits|kill|exit code)"
        keep1 = r"node_rank=1|dist_world_size=|launch\.py.*(exits|kill|exit code)"
    out = [f"simulated 2-node run ({result.launcher}, 2 nodes x 1 CPU process, gloo) in {result.work}"]
    for phase, cmds in result.commands.items():
        out.append(f"--- {phase}")
        out += [f"  node {i}$ {shown(c)}" for i, c in enumerate(cmds)]
        for i, log in enumerate(result.logs[phase]):
            tail = log_tail(log, keep0 if i == 0 else keep1, 12 if i == 0 else 3)
            out += [f"  [{log.name}] {GLOG_PREFIX.sub('', ln)[:240]}" for ln in tail]
    out.append("--- checks")
    out += [c.line() for c in result.checks]
    out.append(f"{'PASSED' if result.ok else 'FAILED'} in {result.seconds:.0f} s")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launcher", choices=LAUNCHERS, default="torchrun")
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "simulate_2node",
                   help="configs, node logs and run folders (default runs/simulate_2node)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--kill-after", type=int, default=6, help="kill node 1 once rank 0 logged this step")
    p.add_argument("--dist-timeout-s", type=int, default=30, help="the trainer's dist_timeout_s")
    p.add_argument("--launcher-death", action="store_true",
                   help="instead: SIGKILL only node 1's launcher (its worker lives on) and report what node 0 does")
    args = p.parse_args(argv)
    if args.launcher_death:
        result = launcher_death(args.work, args.launcher, args.steps, args.ckpt_every, args.kill_after,
                                args.dist_timeout_s)
    else:
        result = simulate(args.work, args.launcher, args.steps, args.ckpt_every, args.kill_after,
                          args.dist_timeout_s)
    print(report(result), flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
