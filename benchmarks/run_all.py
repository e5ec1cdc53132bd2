"""Run every benchmark (``make bench``) and write ``<out>/SUMMARY.md`` with all their tables.

One process for all (importing torch + transformers is slow); a failing benchmark is reported and
the others still run (exit status 1).

    python -m benchmarks.run_all [--smoke] [--device cuda] [--out DIR | --record] [--only prefill,moe] [-- EXTRA ARGS]

The results go to runs/bench/ unless ``--record`` (``make bench RECORD=1``) asks for benchmarks/results/,
the recorded figures that README.md and docs/ quote.
"""
from __future__ import annotations

import argparse
import json
import importlib
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.cli import add_out_args, out_dir
from benchmarks.harness import free_memory
from benchmarks.machine import machine_info

BENCHMARKS = ("prefill", "decode", "inference", "moe", "train", "train_packed", "attention", "dechunk", "expert_parallel",
              "overhead", "vs_transformers", "serving")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run_all", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--threads", default="auto")
    add_out_args(ap)
    ap.add_argument("--only", default=",".join(BENCHMARKS), help="comma list of benchmarks to run")
    ap.add_argument("--summary-only", action="store_true",
                    help="run nothing; write SUMMARY.md from the <name>.md files already in --out (gpu.sh)")
    args = ap.parse_args(argv)
    args.out = str(out_dir(args))
    if args.summary_only:
        out = Path(args.out)
        status, info = {}, None
        for path in sorted(out.glob("*.json"), key=_order):
            data = json.loads(path.read_text())
            info = info or data.get("machine")
            st = "partial (interrupted)" if data.get("partial") else "ok"
            status[path.stem] = (f"{st}, git {data.get('machine', {}).get('git')}", None, None)
        names = list(status)
        # the files may come from several runs: each one's commit is in its status line
        write_summary(out, status, None, args, dict(info or {}, git="per benchmark below"))
        print(f"wrote {out / 'SUMMARY.md'} ({', '.join(names)})")
        return 0
    shared = ["--device", args.device, "--threads", str(args.threads), "--out", args.out]
    if args.dtype:
        shared += ["--dtype", args.dtype]
    if args.smoke:
        shared.append("--smoke")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    status = {}
    for name in [b.strip() for b in args.only.split(",") if b.strip()]:
        if name not in BENCHMARKS:
            raise SystemExit(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
        t0 = time.perf_counter()
        print(f"=== {name} ===", flush=True)
        try:
            importlib.import_module(f"benchmarks.{name}").run(shared + extra)
            status[name] = ("ok", time.perf_counter() - t0, None)
        except Exception as err:  # noqa: BLE001 - one failing benchmark must not hide the others
            traceback.print_exc()
            status[name] = ("FAILED", time.perf_counter() - t0, f"{err.__class__.__name__}: {err}")
        free_memory(torch.device(args.device))
    total = time.perf_counter() - t_all
    write_summary(out, status, total, args)
    print(f"=== done in {total:.0f} s; summary: {out / 'SUMMARY.md'}", flush=True)
    return 0 if all(v[0] == "ok" for v in status.values()) else 1


def _order(path: Path):
    stem = path.stem
    base = stem if stem in BENCHMARKS else stem.split("_")[0]
    return (BENCHMARKS.index(base) if base in BENCHMARKS else len(BENCHMARKS), stem)


def write_summary(out: Path, status: dict, total: float | None, args, info: dict | None = None) -> None:
    info = info or machine_info(torch.device(args.device))
    lines = ["# Benchmark summary", "",
             f"`python -m benchmarks.run_all {'--smoke ' if args.smoke else ''}--device {args.device}` on "
             f"{info.get('gpu') or info.get('cpu')} ({info.get('usable_cores')} usable cores, "
             f"torch {info.get('torch')}, "
             f"transformers {info.get('transformers')}, git {info.get('git')}), {info.get('timestamp')}; "
             f"torch threads {info.get('torch_threads')} (choice: {info.get('thread_choice')}); load average "
             f"{info.get('load_average_1_5_15')}."
             + (f" Total wall time {total / 60:.1f} min." if total is not None else ""), "",
             "Every figure below compares variants timed IN THE SAME RUN, interleaved round by round, warm-up "
             "excluded, medians [IQR]; quote ratios, not latencies (see benchmarks/harness.py).", "",
             "| benchmark | status | wall time |", "|---|---|---:|"]
    for name, (st, secs, err) in status.items():
        lines.append(f"| {name} | {st}{': ' + err if err else ''} | {f'{secs:.0f} s' if secs is not None else 'n/a'} |")
    lines.append("")
    for name in status:
        md = out / f"{name}.md"
        if md.is_file() and status[name][0] != "FAILED":
            text = md.read_text().rstrip()
            lines += [text, "", f"![{name}]({name}.png)", ""]
    (out / "SUMMARY.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
