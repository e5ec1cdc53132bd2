"""``make eval``: score a checkpoint with the real lmms-eval CLI, offline, and check it really did.

    python -m eval_suites.run --checkpoint runs/train-vlm/hf --tasks cmoe_digits_vqa,cmoe_digits_mc [-- LMMS-EVAL ARGS]

Exit codes: 0 results for every task; 1 lmms-eval produced no (complete) results; 2 bad arguments.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
from importlib import metadata

from torch.distributed.elastic.utils.distributed import get_free_port

from eval_suites.common import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_CPU_THREADS,
    LOCAL_TASK_PREFIX,
    REPO_ROOT,
    TASKS_DIR,
    checkpoint_problem,
)

MODEL_NAME = "conceptmoe_vlm"
ENTRY_POINT_GROUP = "lmms_eval.models"
EXIT_OK, EXIT_EVAL_FAILED, EXIT_USAGE = 0, 1, 2


def entry_point_installed() -> bool:
    try:
        eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    except TypeError:  # pragma: no cover - Python < 3.10 API
        eps = metadata.entry_points().get(ENTRY_POINT_GROUP, [])
    return any(ep.name == MODEL_NAME for ep in eps)


def lmms_eval_command(args, output_dir: str) -> list[str]:
    model_args = f"pretrained={os.path.abspath(args.checkpoint)},dtype={args.dtype}"
    if args.device:
        model_args += f",device={args.device}"
    model_args += f",cpu_threads={args.cpu_threads}"
    if args.model_args:
        model_args += "," + args.model_args
    launcher = ["-m", "lmms_eval"] if entry_point_installed() else ["-m", "eval_suites.lmms_cli"]
    cmd = [sys.executable, *launcher, "--model", MODEL_NAME, "--model_args", model_args,
           "--tasks", args.tasks, "--include_path", os.path.abspath(args.tasks_dir), "--output_path", output_dir,
           "--batch_size", str(args.batch_size)]
    if args.limit is not None:
        cmd += ["--limit", str(args.limit)]
    if args.gen_kwargs:
        cmd += ["--gen_kwargs", args.gen_kwargs]
    if args.log_samples:
        cmd += ["--log_samples"]
    return cmd + list(args.extra)


def subprocess_env(args, data_eval_dir: str) -> dict:
    env = dict(os.environ)
    if not args.online:
        env["HF_HUB_OFFLINE"] = "1"
        env["HF_DATASETS_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
    if args.hf_home:
        env["HF_HOME"] = os.path.abspath(os.path.expanduser(args.hf_home))
    env["CMOE_DATA_DIR"] = os.path.abspath(data_eval_dir)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # lmms-eval starts a one-process group: give every run its own port, never an inherited one
    # (two runs at once, or a parent that already holds MASTER_PORT, would collide)
    env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", str(get_free_port())
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def find_results(output_dir: str, since: float) -> str | None:
    """The newest ``*_results.json`` lmms-eval wrote under ``output_dir`` after ``since``."""
    found = [p for p in glob.glob(os.path.join(output_dir, "**", "*_results.json"), recursive=True)
             if os.path.getmtime(p) >= since - 1]
    return max(found, key=os.path.getmtime) if found else None


def missing_tasks(results: dict, requested: list[str]) -> list[str]:
    present = set(results.get("results", {})) | set(results.get("groups", {})) | set(results.get("group_subtasks", {}))
    return [t for t in requested if t not in present and "*" not in t]


def results_table(results: dict) -> str:
    rows = [("task", "metric", "value", "stderr")]
    for task, metrics in sorted(results.get("results", {}).items()):
        for key, value in metrics.items():
            if key == "alias" or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, _, filt = key.partition(",")
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            rows.append((task, metric if filt in ("", "none") else key, f"{value:.4f}",
                         f"{stderr:.4f}" if isinstance(stderr, (int, float)) else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def failure_reason(log_text: str, hf_home: str | None = None) -> str:
    offline = re.findall(r"ConnectionError: Couldn't reach '([^'{}]+)' on the Hub", log_text)
    if offline:
        return (f"dataset {offline[-1]} is not in the offline datasets cache "
                f"(HF_HOME={hf_home or '~/.cache/huggingface'}): fill it from local parquet files "
                f"with python -m eval_suites.stock_data --task TASK --split SPLIT=FILES (eval_suites/README.md)")
    if "Currently messages is used for generation only" in log_text:
        return ("interface=chat runs generation tasks only (lmms-eval builds no loglikelihood requests from "
                "messages); run multiple_choice / loglikelihood tasks with the default interface=simple")
    for pattern in (r"Tasks not found: (.+?)\. Try", r"Tasks were not found: ([^\n]+)"):
        match = re.search(pattern, log_text)
        if match:
            return f"unknown task(s): {match.group(1).strip()}"
    errors = re.findall(r"Error during evaluation: (.+?)(?:\. Please set|\n|$)", log_text)
    if errors:
        return errors[-1].strip()
    lines = [ln for ln in log_text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "lmms-eval printed nothing"


def run_streaming(cmd, env, log_path: str, quiet: bool) -> tuple[int, str]:
    """Run ``cmd``; its combined output goes to the console (unless quiet) and to ``log_path``."""
    chunks = []
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, env=env, cwd=str(REPO_ROOT), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            chunks.append(line)
            log.write(line)
            if not quiet:
                sys.stdout.write(line)
                sys.stdout.flush()
        code = proc.wait()
    return code, "".join(chunks)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="HF export folder (model + processor), e.g. runs/train-vlm/hf")
    parser.add_argument("--tasks", default="cmoe_digits_vqa,cmoe_digits_mc", help="comma-separated lmms-eval tasks")
    parser.add_argument("--tasks-dir", default=str(TASKS_DIR),
                        help="lmms-eval --include_path (default: eval_suites/tasks; lmms-eval takes one folder)")
    parser.add_argument("--name", default=None, help="run folder name under --out-root (default: a timestamp)")
    parser.add_argument("--out-root", default="runs/eval", help="parent folder of the run folders")
    parser.add_argument("--data", default="data/default", help="default-data folder (for the local cmoe_* tasks)")
    parser.add_argument("--eval-data", default=None, help="task parquet folder (default: <data>/eval; built if needed)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:0 (default: cuda if available)")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | auto")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--cpu-threads", default=str(DEFAULT_CPU_THREADS),
                        help="torch threads on CPU, the trainer's cpu_threads (default 1, as configs/train/default.yaml: "
                             "this model's matmuls are too small for more to pay off); auto = OMP_NUM_THREADS, else "
                             "all cores")
    parser.add_argument("--limit", type=float, default=None, help="docs per task (testing only)")
    parser.add_argument("--gen-kwargs", default="", help="lmms-eval --gen_kwargs string")
    parser.add_argument("--model-args", default="", help="extra model_args, e.g. max_new_tokens=16")
    parser.add_argument("--no-log-samples", dest="log_samples", action="store_false",
                        help="do not write the per-sample JSONL files")
    parser.add_argument("--hf-home", default=None,
                        help="HF_HOME for lmms-eval: stock tasks read their data from its datasets cache "
                             "(fill it with python -m eval_suites.stock_data)")
    parser.add_argument("--online", action="store_true", help="do not force HF_HUB_OFFLINE / HF_DATASETS_OFFLINE")
    parser.add_argument("--quiet", action="store_true", help="only the summary (lmms-eval output still goes to the log)")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more lmms-eval arguments")
    args = parser.parse_args(argv)
    if args.extra and args.extra[0] == "--":
        args.extra = args.extra[1:]
    if args.limit is not None and args.limit == int(args.limit):
        args.limit = int(args.limit)
    from eval_suites.lmms_inputs import as_cpu_threads
    try:
        args.cpu_threads = as_cpu_threads(args.cpu_threads) or "auto"
    except ValueError as err:
        parser.error(str(err).removeprefix("conceptmoe_vlm: ").replace("cpu_threads", "--cpu-threads"))
    return args


def main(argv=None) -> int:
    """Check the checkpoint, build the local ``cmoe_*`` task data if needed, run lmms-eval (or
    ``eval_suites.lmms_cli`` without the installed entry point) in a subprocess with the hub offline,
    its output streamed to ``runs/eval/<name>/lmms_eval.log``, then require a ``*_results.json``
    holding every requested task: lmms-eval's CLI exits 0 even when a task is unknown or the model
    crashed. On success the results file is copied to ``runs/eval/<name>/results.json``."""
    args = parse_args(argv)
    problem = checkpoint_problem(args.checkpoint)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    requested = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not requested:
        print("error: no tasks given", file=sys.stderr)
        return EXIT_USAGE
    args.tasks = ",".join(requested)

    eval_data = args.eval_data or os.path.join(args.data, "eval")
    if any(t.startswith(LOCAL_TASK_PREFIX) for t in requested):
        from eval_suites.build_tasks import build

        try:
            build(args.data, eval_data, quiet=True)
        except (FileNotFoundError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_USAGE

    name = args.name or time.strftime("%Y%m%d-%H%M%S")
    output_dir = os.path.abspath(os.path.join(args.out_root, name))
    os.makedirs(output_dir, exist_ok=True)
    cmd = lmms_eval_command(args, output_dir)
    log_path = os.path.join(output_dir, "lmms_eval.log")
    print(f"[eval] {' '.join(cmd)}", flush=True)
    started = time.time()
    env = subprocess_env(args, eval_data)
    code, log_text = run_streaming(cmd, env, log_path, args.quiet)

    results_path = find_results(output_dir, started)
    if results_path is None:
        print(f"error: lmms-eval wrote no results (exit code {code}): {failure_reason(log_text, env.get('HF_HOME'))}; "
              f"log: {log_path}", file=sys.stderr)
        return EXIT_EVAL_FAILED
    with open(results_path, encoding="utf-8") as f:
        results = json.load(f)
    absent = missing_tasks(results, requested)
    if absent:
        print(f"error: no results for task(s) {', '.join(absent)}; log: {log_path}", file=sys.stderr)
        return EXIT_EVAL_FAILED
    shutil.copyfile(results_path, os.path.join(output_dir, "results.json"))
    print(f"\n[eval] {args.checkpoint} -> {output_dir}")
    print(results_table(results))
    print(f"[eval] results: {os.path.join(output_dir, 'results.json')} (lmms-eval: {results_path})")
    if code != 0:
        print(f"warning: lmms-eval exited with code {code} after writing results", file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
