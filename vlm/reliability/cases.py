"""The fault cases: each injects one failure into a real 2-process ZeRO-2 CPU run, checks what it
left on disk, resumes with ``--resume auto`` and requires the resumed run to redo the lost steps
with the same losses and end on the reference run's parameters (max |diff| <= 1e-6, fp32)."""
from __future__ import annotations

import random
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from vlm.reliability.harness import (
    CKPT_EVERY,
    STEPS,
    TOL,
    Run,
    fault_config,
    latest_pointer,
    max_param_diff,
    newest_step,
)

SAVE_STEP = 10            # the checkpoint the save faults hit (the previous one is step 5)
STALL_TIMEOUT_S = 10      # dist_timeout_s of the rank-death runs
DEATH_BOUND_S = 30        # a dead peer must be noticed within this (a stalled one: timeout + this)


@dataclass
class Trial:
    case: str
    ok: bool
    detail: str
    redone_steps: int | None = None   # steps after the newest checkpoint that had to be trained again
    param_diff: float | None = None   # max |final params - reference|
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def reference(work: Path) -> Path:
    """The uninterrupted run every case is compared with (trained once per suite)."""
    run = Run(fault_config(work, "reference"))
    rc = run.wait(900)
    if rc != 0:
        run.stop()
        raise RuntimeError(f"reference run failed (exit {rc}):\n{run.output()[-3000:]}")
    return run.run_dir


def _tail(text: str, n: int = 1) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[:300]


def _resume_and_check(config: Path, ref_dir: Path, before: list[dict], expect_from: int) -> tuple[bool, str, float]:
    """Resume ``config`` with --resume auto; compare with the killed run's log and the reference."""
    run = Run(config, resume="auto")
    rc = run.wait(900)
    if rc is None:
        run.stop()
        return False, "the resumed run hung", float("nan")
    if rc != 0:
        return False, f"the resumed run failed (exit {rc}): {_tail(run.output(), 3)}", float("nan")
    after = run.records()[len(before):]
    if not after or after[0]["step"] != expect_from + 1 or after[-1]["step"] != STEPS:
        got = [r["step"] for r in after][:3]
        return False, f"resumed at steps {got}..., expected {expect_from + 1}..{STEPS}", float("nan")
    killed = {r["step"]: r["loss"] for r in before}
    redo = [abs(r["loss"] - killed[r["step"]]) for r in after if r["step"] in killed]
    loss_diff = max(redo, default=0.0)
    diff = max_param_diff(run.run_dir, ref_dir)
    ok = loss_diff <= TOL and diff <= TOL
    return ok, f"resumed from step {expect_from}; redone-loss |diff| {loss_diff:.1e}; params |diff| {diff:.1e}", diff


def kill9(work: Path, ref_dir: Path, trial: int, seed: int) -> Trial:
    """SIGKILL one worker (random rank) at a random step, at a random moment within it; the
    launcher must tear the run down (no hang)."""
    rng = random.Random(seed * 1000 + trial)
    target, rank, delay = rng.randint(CKPT_EVERY + 1, STEPS - 8), rng.randrange(2), rng.uniform(0.0, 0.3)
    config = fault_config(work, f"kill9-{trial}")
    t0 = time.monotonic()
    run = Run(config)
    try:
        reached = run.wait_for_step(target)
        if reached is None:
            return Trial("kill -9 (random rank, random step)", False, f"exited before step {target}: {_tail(run.output())}")
        time.sleep(delay)
        run.kill(rank)
        rc = run.wait(120)
    finally:
        run.stop()
    before = run.records()
    if rc is None:
        return Trial("kill -9 (random rank, random step)", False, "the launcher did not exit after a worker died")
    killed_at, newest = before[-1]["step"], newest_step(run.ckpt_dir)
    ok, detail, diff = _resume_and_check(config, ref_dir, before, newest)
    return Trial("kill -9 (random rank, random step)", ok,
                 f"rank {rank} killed after step {killed_at}; {detail}", killed_at - newest, diff, time.monotonic() - t0)


def kill_in_save(work: Path, ref_dir: Path, point: str) -> Trial:
    """SIGKILL rank 0 at ``point`` of the step-10 save."""
    case = f"kill -9 in checkpoint write: {point}"
    config = fault_config(work, f"killsave-{point}")
    t0 = time.monotonic()
    run = Run(config, fault=f"kill:{point}:{SAVE_STEP}")
    rc = run.wait(600)
    run.stop()
    if rc in (None, 0):
        return Trial(case, False, f"expected the run to die at the step-{SAVE_STEP} save (exit {rc})")
    renamed = point in ("before_latest", "after_save")
    want_newest = SAVE_STEP if renamed else SAVE_STEP - CKPT_EVERY
    want_latest = f"step_{SAVE_STEP if point == 'after_save' else SAVE_STEP - CKPT_EVERY:06d}"
    newest, latest = newest_step(run.ckpt_dir), latest_pointer(run.ckpt_dir)
    if newest != want_newest or latest != want_latest:
        return Trial(case, False, f"on disk: newest complete step {newest}, latest -> {latest}; "
                                  f"expected {want_newest} / {want_latest}")
    before = run.records()
    ok, detail, diff = _resume_and_check(config, ref_dir, before, newest)
    return Trial(case, ok, f"newest complete checkpoint step {newest}, latest -> {latest}; {detail}",
                 before[-1]["step"] - newest, diff, time.monotonic() - t0)


def enospc(work: Path, ref_dir: Path, point: str, rank: int = 0) -> Trial:
    """The disk refuses a write at ``point`` (on ``rank``) during the step-10 save: a clear error
    (exit 5) on every rank, the previous checkpoint intact, nothing half-written marked latest."""
    case = f"ENOSPC in checkpoint write: {point} (rank {rank})"
    config = fault_config(work, f"enospc-{point}-r{rank}")
    t0 = time.monotonic()
    run = Run(config, fault=f"enospc:{point}:{SAVE_STEP}:{rank}")
    rc = run.wait(600)
    run.stop()
    out = run.output()
    errors = [ln for ln in out.splitlines() if ln.startswith("error: checkpoint")]
    if rc is None or rc == 0 or len(errors) != 1 or "No space left on device" not in errors[0]:
        return Trial(case, False, f"expected exit 5 and one ENOSPC error line; exit {rc}: {_tail(out, 2)}")
    ck = run.ckpt_dir
    newest, latest = newest_step(ck), latest_pointer(ck)
    want_newest = SAVE_STEP if point == "latest" else SAVE_STEP - CKPT_EVERY
    leftovers = sorted(p.name for p in ck.iterdir() if p.name.endswith(".tmp"))
    if newest != want_newest or latest != f"step_{SAVE_STEP - CKPT_EVERY:06d}" or leftovers:
        return Trial(case, False, f"on disk: newest step {newest}, latest -> {latest}, leftovers {leftovers}")
    before = run.records()
    ok, detail, diff = _resume_and_check(config, ref_dir, before, newest)
    return Trial(case, ok, f"'{errors[0][:90]}...'; latest -> {latest}; {detail}",
                 before[-1]["step"] - newest, diff, time.monotonic() - t0)


def rank_death(work: Path, ref_dir: Path, mode: str = "dies", at_step: int = 8) -> Trial:
    """Rank 1 of two bare processes (no launcher watching both, as across two nodes) dies (SIGKILL)
    or stalls (SIGSTOP) after ``at_step``: rank 0 must exit with a clear message (exit 4) within a
    bounded time (the collective timeout, ``dist_timeout_s``)."""
    case = f"rank 1 {mode} ({'SIGKILL' if mode == 'dies' else 'SIGSTOP'}), no launcher"
    config = fault_config(work, f"rank-{mode}", dist_timeout_s=STALL_TIMEOUT_S)
    bound = DEATH_BOUND_S + (STALL_TIMEOUT_S if mode == "stalls" else 0)
    t0 = time.monotonic()
    run = Run(config, launcher="manual")
    try:
        if run.wait_for_step(at_step) is None:
            return Trial(case, False, f"exited before step {at_step}: {_tail(run.output())}")
        run.kill(1, signal.SIGKILL if mode == "dies" else signal.SIGSTOP)
        t_fault = time.monotonic()
        rc0 = run.wait(bound + 30, proc=0)
        waited = time.monotonic() - t_fault
    finally:
        run.stop()
    log0 = run.logs[0].read_text(errors="replace")
    msg = [ln for ln in log0.splitlines() if ln.startswith("error: rank 0: lost the other ranks")]
    if rc0 is None:
        return Trial(case, False, f"rank 0 still waiting {bound + 30} s after the fault (hang)")
    if rc0 != 4 or not msg or waited > bound:
        return Trial(case, False, f"rank 0 exit {rc0} after {waited:.1f} s (bound {bound} s): {_tail(log0, 2)}")
    before = run.records()
    newest = newest_step(run.ckpt_dir)
    ok, detail, diff = _resume_and_check(config, ref_dir, before, newest)
    return Trial(case, ok, f"rank 0 exit 4 after {waited:.1f} s (bound {bound} s): '{msg[0][:80]}...'; {detail}",
                 before[-1]["step"] - newest, diff, time.monotonic() - t0)
