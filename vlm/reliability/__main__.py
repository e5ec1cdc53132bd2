"""``python -m vlm.reliability``: run the fault cases and the soak, print and write the table.

    python -m vlm.reliability                       # everything (`make faults`)
    python -m vlm.reliability --quick               # the CI subset
    python -m vlm.reliability --only kill9,enospc --trials 10 --seed 3

Writes ``<out>/faults.md`` and ``<out>/faults.json``; exits 1 if any case failed.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

GROUPS = ("kill9", "save", "enospc", "rank", "soak")
SAVE_POINTS = ("after_engine", "before_state", "before_rename", "before_latest", "after_save")
ENOSPC_POINTS = (("engine", 1), ("engine", 0), ("rank_state", 1), ("trainer_state", 0), ("latest", 0))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vlm.reliability", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/faults", help="work folder and report (default runs/faults)")
    p.add_argument("--trials", type=int, default=5, help="kill -9 trials at random steps (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random kill steps / ranks")
    p.add_argument("--soak-steps", type=int, default=2000)
    p.add_argument("--only", default=",".join(GROUPS), help=f"comma list of {', '.join(GROUPS)}")
    p.add_argument("--quick", action="store_true", help="the CI subset: 1 trial, fewer points, 300-step soak")
    return p.parse_args(argv)


def table(trials: list, soak) -> str:
    lines = ["| case | trials | survived | data lost beyond the last checkpoint | steps redone | max param diff |",
             "|---|---:|---:|---|---:|---:|"]
    by_case: dict[str, list] = {}
    for t in trials:
        by_case.setdefault(t.case, []).append(t)
    for case, ts in by_case.items():
        ok = sum(t.ok for t in ts)
        redone = sorted({t.redone_steps for t in ts if t.redone_steps is not None})
        diffs = [t.param_diff for t in ts if t.param_diff is not None and t.param_diff == t.param_diff]
        lost = "none" if ok == len(ts) else f"{len(ts) - ok} failed"
        span = "-" if not redone else (f"{redone[0]}" if len(redone) == 1 else f"{redone[0]}-{redone[-1]}")
        diff = f"{max(diffs):.1e}" if diffs else "-"
        lines.append(f"| {case} | {len(ts)} | {ok} | {lost} | {span} | {diff} |")
    if soak is not None:
        lines += ["", "| soak | steps | ckpt every | RSS warm -> end (peak), MiB | growth | open fds | max ckpts | result |",
                  "|---|---:|---:|---|---:|---|---:|---|",
                  (f"| tiny VLM, default data | {soak.steps} | {soak.ckpt_every} | {soak.rss_warm_mib:.0f} -> "
                   f"{soak.rss_end_mib:.0f} ({soak.rss_peak_mib:.0f}) | {soak.rss_growth:+.1%} | {soak.fds_warm} -> "
                   f"{soak.fds_end} | {soak.max_ckpts_seen} | {'pass' if soak.ok else 'FAIL'} |")]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from vlm.train import _quiet_imports

    _quiet_imports()
    from vlm.reliability import cases
    from vlm.reliability.soak import run_soak

    only = {g.strip() for g in args.only.split(",") if g.strip()}
    if only - set(GROUPS):
        print(f"error: --only: unknown group(s) {sorted(only - set(GROUPS))}; choose from {', '.join(GROUPS)}",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.monotonic()
    trials, soak = [], None
    n_trials = 1 if args.quick else args.trials
    save_points = ("after_engine", "before_latest") if args.quick else SAVE_POINTS
    enospc_points = ENOSPC_POINTS[:1] + ENOSPC_POINTS[3:4] if args.quick else ENOSPC_POINTS
    modes = ("dies",) if args.quick else ("dies", "stalls")

    def record(trial):
        trials.append(trial)
        print(f"[faults] {'ok  ' if trial.ok else 'FAIL'} {trial.case}: {trial.detail} ({trial.seconds:.0f} s)", flush=True)

    if only & {"kill9", "save", "enospc", "rank"}:
        print("[faults] reference run (2-process ZeRO-2, uninterrupted) ...", flush=True)
        ref = cases.reference(work)
        for i in range(n_trials) if "kill9" in only else ():
            record(cases.kill9(work, ref, i, args.seed))
        for point in save_points if "save" in only else ():
            record(cases.kill_in_save(work, ref, point))
        for point, rank in enospc_points if "enospc" in only else ():
            record(cases.enospc(work, ref, point, rank))
        for mode in modes if "rank" in only else ():
            record(cases.rank_death(work, ref, mode))
    if "soak" in only:
        steps = 300 if args.quick else args.soak_steps
        print(f"[faults] soak: {steps} steps ...", flush=True)
        soak = run_soak(work, steps=steps, ckpt_every=50 if args.quick else 100)
        print(f"[faults] soak {'ok' if soak.ok else 'FAIL'}: {soak.detail}", flush=True)
    md = table(trials, soak)
    wall = time.monotonic() - t0
    ok = all(t.ok for t in trials) and (soak is None or soak.ok)
    header = (f"# make faults\n\n{time.strftime('%Y-%m-%d %H:%M')}, {wall / 60:.1f} min, seed {args.seed}"
              f"{', quick subset' if args.quick else ''}: {'all passed' if ok else 'FAILURES'}.\n\n")
    (out / "faults.md").write_text(header + md + "\n\n## Trials\n\n" + "\n".join(
        f"- {'ok' if t.ok else 'FAIL'} {t.case}: {t.detail}" for t in trials) + "\n")
    (out / "faults.json").write_text(json.dumps({"ok": ok, "wall_s": wall, "seed": args.seed, "quick": args.quick,
                                                 "trials": [t.to_dict() for t in trials],
                                                 "soak": soak.to_dict() if soak else None}, indent=1))
    print("\n" + md + f"\n\n[faults] {'all passed' if ok else 'FAILURES'} in {wall / 60:.1f} min; "
          f"report {out / 'faults.md'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
