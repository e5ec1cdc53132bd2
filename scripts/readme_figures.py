"""The README's headline figures of the demo, rendered from the files a run writes, never typed by hand.

    make train-vlm && make eval EVAL_ARGS="--name train-vlm"
    python scripts/readme_figures.py --publish runs/train-vlm --eval runs/eval/train-vlm [--commit SHA]
    python scripts/readme_figures.py --check      # exit 1 when README.md differs from those files

``--publish`` copies the run's ``summary.json`` (written by ``make train-vlm``) and the eval's
``results.json`` (written by ``make eval``) unchanged into ``docs/results/train-vlm/``, with ``run.json``
(the run's commit, whether this tree's code / configs differ from it, date, CPU count, the model's target
R), then rewrites every README span between ``<!-- figures:KEY -->`` and ``<!-- /figures -->`` from those
files. ``--check`` (and tests/test_readme_figures.py) compares.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "train-vlm"
README = ROOT / "README.md"
RUN_INPUTS = ("vlm", "data_pipelines", "vision_encoders", "configs", "Makefile", "pyproject.toml")
SPAN = re.compile(r"<!-- figures:(\w+) -->(.*?)<!-- /figures -->", re.DOTALL)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def render_train(summary: dict, run: dict) -> str:
    """The demo's sentence: accuracy (+ breakdown), eval R, throughput and wall time, where from."""
    ev = summary["eval"]
    parts = ", ".join(f"{kind.replace('_', '-')} {acc:.0%}" for kind, acc in ev["by_kind"].items())
    dirty = ", uncommitted changes" if run["dirty"] else ""
    return (f"Last run (commit {run['commit'][:7]}{dirty}, {run['cpu_count']} CPU cores; "
            f"`docs/results/train-vlm/summary.json`): **{ev['accuracy']:.1%} held-out accuracy** "
            f"({ev['correct']}/{ev['total']}; {parts}; chance is 10% for the digit question), achieved eval ratio "
            f"{ev['ratio']:.2f} pooled (image {ev['ratio_image']:.2f}, text {ev['ratio_text']:.2f}; target "
            f"{run['target_ratio']:g}), {summary['tokens_seen'] / summary['train_time_s']:,.0f} tokens/s, "
            f"{_duration(summary['wall_time_s'])} wall.")


def render_eval(results: dict) -> str:
    """lmms-eval's scores of the demo's export (``make eval``'s results.json)."""
    mc, vqa = results["results"]["cmoe_digits_mc"], results["results"]["cmoe_digits_vqa"]
    n = results["n-samples"]
    return (f"`cmoe_digits_mc` acc **{mc['acc,none']:.3f}** (± {mc['acc_stderr,none']:.3f}), `cmoe_digits_vqa` "
            f"exact match **{vqa['exact_match,none']:.3f}** (± {vqa['exact_match_stderr,none']:.3f}), "
            f"{n['cmoe_digits_mc']['effective']} / {n['cmoe_digits_vqa']['effective']} held-out questions "
            f"(`docs/results/train-vlm/results.json`)")


def rendered(results_dir: Path = RESULTS) -> dict[str, str]:
    def load(name):
        return json.loads((results_dir / name).read_text(encoding="utf-8"))

    return {"train": render_train(load("summary.json"), load("run.json")), "eval": render_eval(load("results.json"))}


def readme_spans(text: str) -> dict[str, str]:
    spans = {}
    for match in SPAN.finditer(text):
        if match.group(1) in spans:
            raise ValueError(f"README: figures:{match.group(1)} marked twice")
        spans[match.group(1)] = match.group(2)
    return spans


def rewrite(text: str, figures: dict[str, str]) -> str:
    missing = set(figures) - set(readme_spans(text))
    if missing:
        raise ValueError(f"README: no <!-- figures:{min(missing)} --> span")
    return SPAN.sub(lambda m: f"<!-- figures:{m.group(1)} -->{figures[m.group(1)]}<!-- /figures -->", text)


def publish(run_dir: Path, eval_dir: Path, commit: str = "HEAD", out: Path = RESULTS) -> None:
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run_dir / "summary.json", out / "summary.json")
    shutil.copyfile(eval_dir / "results.json", out / "results.json")
    text_config = json.loads((run_dir / "hf" / "config.json").read_text())["text_config"]
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", commit], capture_output=True, text=True, check=True).stdout.strip()
    # the run's inputs (code, configs, the Makefile) in this tree differ from that commit
    dirty = subprocess.run([*git, "diff", "--quiet", commit, "--", *RUN_INPUTS], check=False).returncode != 0
    run = {"commit": commit, "dirty": dirty, "published": time.strftime("%Y-%m-%d %H:%M"),
           "cpu_count": os.cpu_count(), "target_ratio": text_config["target_ratio"],
           "run_dir": str(run_dir), "eval_dir": str(eval_dir)}
    (out / "run.json").write_text(json.dumps(run, indent=1) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--publish", type=Path, help="a make train-vlm run folder (summary.json, hf/)")
    ap.add_argument("--eval", type=Path, help="a make eval run folder (results.json)")
    ap.add_argument("--commit", default="HEAD", help="the commit the run was made at (default: HEAD)")
    ap.add_argument("--check", action="store_true", help="exit 1 when README.md differs from the files (the default)")
    args = ap.parse_args(argv)
    if bool(args.publish) != bool(args.eval) or (args.check and args.publish):
        ap.error("give --publish RUN --eval EVAL, or --check")
    if args.publish:
        publish(args.publish, args.eval, args.commit)
        README.write_text(rewrite(README.read_text(encoding="utf-8"), rendered()), encoding="utf-8")
        print(f"[figures] {RESULTS.relative_to(ROOT)} <- {args.publish}, {args.eval}; README.md rewritten")
        return 0
    text = README.read_text(encoding="utf-8")
    stale = [key for key, value in rendered().items() if readme_spans(text).get(key) != value]
    if stale:
        print(f"error: README.md figures {stale} differ from docs/results/train-vlm/: run --publish", file=sys.stderr)
        return 1
    print("[figures] README.md matches docs/results/train-vlm/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
