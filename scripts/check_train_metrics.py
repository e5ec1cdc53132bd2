"""Check a training run's metrics.jsonl: the loss falls and nothing is NaN / inf.

    python scripts/check_train_metrics.py runs/gpu_check/metrics.jsonl [--steps 100] [--min-drop 0.0]

Fails (exit 1, one line per problem) when: there are fewer than two step records; any value
anywhere in a record is NaN / inf (the trainer writes them as the strings "nan" / "inf"), or a
loss is missing / null; a step was skipped as non-finite (``skipped_steps``, ``nonfinite_loss``);
the last record's ``loss`` is not below the first one's by more than ``--min-drop`` (a fraction
of the first); ``--steps`` is given and the last record is not that step. Prints one summary line.
Used by scripts/gpu_check.sh; plain Python, no torch.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

LOSSES = ("loss", "lm_loss")
NONFINITE_STRINGS = {"nan", "-nan", "inf", "-inf", "+inf", "infinity", "-infinity"}


def nonfinite_paths(obj, path: str = ""):
    """Dotted paths of every NaN / inf value (floats or the trainer's "nan" / "inf" strings)."""
    if isinstance(obj, float):
        if not math.isfinite(obj):
            yield path
    elif isinstance(obj, str):
        if obj.strip().lower() in NONFINITE_STRINGS:
            yield path
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from nonfinite_paths(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from nonfinite_paths(v, f"{path}[{i}]")


def check(records: list[dict], steps: int | None = None, min_drop: float = 0.0) -> tuple[list[str], str]:
    problems: list[str] = []
    recs = [r for r in records if isinstance(r, dict) and "step" in r and "loss" in r]
    if len(recs) < 2:
        return [f"need at least 2 step records with a loss, found {len(recs)}"], ""
    for r in recs:
        bad = list(nonfinite_paths(r))
        if bad:
            problems.append(f"step {r['step']}: non-finite {', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}")
        for key in LOSSES:
            if key in r and not isinstance(r[key], (int, float)):
                problems.append(f"step {r['step']}: {key} is {r[key]!r}, not a number")
        for key in ("skipped_steps", "nonfinite_loss"):
            if isinstance(r.get(key), (int, float)) and r[key] > 0:
                problems.append(f"step {r['step']}: {key} = {r[key]} (a non-finite step was skipped)")
    first, last = recs[0], recs[-1]
    if steps is not None and last["step"] != steps:
        problems.append(f"last record is step {last['step']}, expected {steps}")
    l0, l1 = first["loss"], last["loss"]
    summary = ""
    if isinstance(l0, (int, float)) and isinstance(l1, (int, float)) and math.isfinite(l0) and math.isfinite(l1):
        drop = (l0 - l1) / abs(l0) if l0 else 0.0
        summary = (f"loss {l0:.4f} (step {first['step']}) -> {l1:.4f} (step {last['step']}), "
                   f"{drop:+.1%} drop over {len(recs)} records")
        if not l1 < l0 * (1.0 - min_drop):
            problems.append(f"loss did not fall: {summary} (need a drop > {min_drop:.0%})")
    return problems, summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("metrics", help="path to metrics.jsonl")
    ap.add_argument("--steps", type=int, default=None, help="expected step of the last record")
    ap.add_argument("--min-drop", type=float, default=0.0,
                    help="required relative loss drop, last vs first record (default 0: just lower)")
    args = ap.parse_args(argv)
    try:
        with open(args.metrics, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as err:
        print(f"check_train_metrics: FAIL: cannot read {args.metrics}: {err}", file=sys.stderr)
        return 1
    problems, summary = check(records, args.steps, args.min_drop)
    for p in problems:
        print(f"check_train_metrics: FAIL: {p}", file=sys.stderr)
    if problems:
        return 1
    print(f"check_train_metrics: OK: {summary}; no NaN/inf, no skipped steps ({args.metrics})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
