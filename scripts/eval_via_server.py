"""Score an export with lmms-eval's own ``openai`` chat model through ``python -m vlm.serve``, next to the
``conceptmoe_vlm`` plugin on the same samples, and compare the two (docs/serving.md).

    .venv/bin/python scripts/eval_via_server.py --model runs/train-vlm/hf --limit 50 --out runs/eval/via-server

Starts the server on a free 127.0.0.1 port (a random API key, handed over in environment variables only), runs
``python -m lmms_eval --model conceptmoe_vlm`` and then ``python -m lmms_eval --model openai`` (base_url = the
server) on the same tasks, stops the server, and writes ``<out>/summary.json``: per task both scores and how
many replies (cut at the task's stop strings, as scored) are identical. Exit 1 when a run wrote no results or a
request failed (lmms-eval's openai model turns a failed request into an answer), or with ``--check-equal``
when a score or reply differs; 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from eval_suites.common import LOCAL_TASK_PREFIX, TASKS_DIR, checkpoint_problem  # noqa: E402
from eval_suites.run import failure_reason, find_results, missing_tasks  # noqa: E402

SERVED_NAME = "conceptmoe-vl"  # lmms-eval's openai model rewrites requests for names holding o1 / o3 / o4 / gpt-5
FAILED_MARK = "[LMMS_EVAL_REQUEST_FAILED"
NO_MESSAGES_MC = "Currently messages is used for generation only"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the export folder (runs/<name>/hf)")
    ap.add_argument("--tasks", default="cmoe_digits_vqa,cmoe_digits_mc_gen",
                    help="generation tasks (lmms-eval's openai model has no loglikelihood: cmoe_digits_mc_gen, "
                         "not cmoe_digits_mc)")
    ap.add_argument("--limit", type=int, default=None, help="docs per task (default: all)")
    ap.add_argument("--out", default="runs/eval/via-server", help="output folder (plugin/, server/, summary.json)")
    ap.add_argument("--data", default="data/default", help="default-data folder (the cmoe_* task parquet source)")
    ap.add_argument("--eval-data", default=None, help="task parquet folder (default: <data>/eval; built if needed)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--batch-size", type=int, default=8, help="the plugin's batch")
    ap.add_argument("--num-concurrent", type=int, default=8, help="requests lmms-eval's openai model keeps in flight")
    ap.add_argument("--no-plugin", dest="plugin", action="store_false", help="only the run through the server")
    ap.add_argument("--check-equal", action="store_true", help="exit 1 unless scores and replies are identical")
    ap.add_argument("--server-timeout", type=float, default=300.0, help="seconds the server may take to start")
    args = ap.parse_args(argv)
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not args.tasks:
        ap.error("--tasks: no task given")
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be >= 1")
    return args


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log_path: Path) -> None:
    """Until ``/health`` answers 200; the server's log tail when it exits first. No proxy: a local port."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}): {log_path.read_text()[-2000:]}")
        try:
            with opener.open(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"the server was not healthy after {timeout:.0f} s (log: {log_path})")


def lmms_eval(model: str, model_args: str, args, out: Path, env: dict, batch_size: int = 1) -> tuple[dict, float]:
    """``python -m lmms_eval`` (its own CLI) into ``out``; (results, wall seconds). RuntimeError when it wrote
    no results for every task."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lmms_eval", "--model", model, "--model_args", model_args,
           "--tasks", ",".join(args.tasks), "--include_path", str(TASKS_DIR), "--batch_size", str(batch_size),
           "--output_path", str(out), "--log_samples"]
    if args.limit is not None:
        cmd += ["--limit", str(args.limit)]
    print(f"[via-server] $ {' '.join(cmd)}", flush=True)
    started = time.time()
    env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # lmms-eval's one-process group
    with open(out / "lmms_eval.log", "w", encoding="utf-8") as log:
        code = subprocess.run(cmd, env=env, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    wall = time.time() - started
    text = (out / "lmms_eval.log").read_text(errors="replace")
    path = find_results(str(out), started)
    if path is None:
        reason = failure_reason(text)
        if NO_MESSAGES_MC in text and model == "openai":
            reason = ("lmms-eval's openai model is a chat model: it runs generation tasks only (no loglikelihood, "
                      "so no multiple_choice task; use cmoe_digits_mc_gen for cmoe_digits_mc)")
        raise RuntimeError(f"{model}: lmms-eval wrote no results (exit {code}): {reason}; log: {out / 'lmms_eval.log'}")
    results = json.loads(Path(path).read_text())
    absent = missing_tasks(results, args.tasks)
    if absent:
        raise RuntimeError(f"{model}: no results for {', '.join(absent)}; log: {out / 'lmms_eval.log'}")
    return results, wall


def samples(out: Path, task: str) -> dict[int, dict]:
    files = glob.glob(str(out / "**" / f"*_samples_{task}.jsonl"), recursive=True)
    if len(files) != 1:
        raise RuntimeError(f"expected one samples file for {task} under {out}, found {files}")
    rows = [json.loads(line) for line in Path(files[0]).read_text().splitlines() if line.strip()]
    return {row["doc_id"]: row for row in rows}


def reply(row: dict) -> str:
    value = row["filtered_resps"]
    return value[0] if isinstance(value, list) else value


def score(results: dict, task: str) -> tuple[str, float]:
    metrics = results["results"][task]
    key = next(k for k in metrics if k.endswith(",none") and "_stderr" not in k)
    return key.split(",")[0], metrics[key]


def compare(args, runs: dict) -> dict:
    """Per task: each run's score, and the replies (cut at the stop strings: what is scored) that agree."""
    from eval_suites.tasks.cmoe_digits.utils import cut_at_stops as cut

    summary = {}
    for task in args.tasks:
        entry = {}
        per_run = {}
        for name, (results, out) in runs.items():
            entry["metric"], entry[name] = score(results, task)
            per_run[name] = samples(out, task)
        failed = [d for d, row in per_run["server"].items() if FAILED_MARK in reply(row)]
        if failed:
            raise RuntimeError(f"{task}: {len(failed)} request(s) to the server failed (doc ids {failed[:10]}): "
                               f"{reply(per_run['server'][failed[0]])[:300]}")
        entry["samples"] = len(per_run["server"])
        if "plugin" in per_run:
            docs = sorted(per_run["server"])
            if sorted(per_run["plugin"]) != docs:
                raise RuntimeError(f"{task}: the two runs scored different docs")
            differ = [d for d in docs if cut(reply(per_run["server"][d])) != cut(reply(per_run["plugin"][d]))]
            entry["same_replies"] = len(docs) - len(differ)
            entry["differing"] = [{"doc_id": d, "plugin": reply(per_run["plugin"][d]),
                                   "server": reply(per_run["server"][d])} for d in differ[:20]]
        summary[task] = entry
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = checkpoint_problem(args.model)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    eval_data = args.eval_data or os.path.join(args.data, "eval")
    if any(t.startswith(LOCAL_TASK_PREFIX) for t in args.tasks):
        from eval_suites.build_tasks import build

        try:
            build(args.data, eval_data, quiet=True)
        except (FileNotFoundError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = str(Path(args.model).resolve())
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "CMOE_DATA_DIR": str(Path(eval_data).resolve()),
           "LMMS_IMAGE_ENCODE_FORMAT": "PNG",  # lossless: the server decodes the pixels the plugin gets
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
    key, port = secrets.token_hex(16), free_port()
    url = f"http://127.0.0.1:{port}"
    server_log = out / "server.log"
    cmd = [sys.executable, "-m", "vlm.serve", "--model", model, "--port", str(port), "--served-model-name",
           SERVED_NAME, "--device", args.device, "--dtype", args.dtype, "--log-level", "warning"]
    print(f"[via-server] $ {' '.join(cmd)}", flush=True)
    runs, walls = {}, {}
    with open(server_log, "w", encoding="utf-8") as log:
        server = subprocess.Popen(cmd, cwd=str(REPO), env={**env, "VLM_API_KEY": key}, stdout=log,
                                  stderr=subprocess.STDOUT)
    try:
        if args.plugin:  # while the server loads
            plugin_args = f"pretrained={model},dtype={args.dtype},device={args.device}"
            results, walls["plugin"] = lmms_eval("conceptmoe_vlm", plugin_args, args, out / "plugin", env,
                                                 args.batch_size)
            runs["plugin"] = (results, out / "plugin")
        wait_healthy(url, server, args.server_timeout, server_log)
        openai_args = (f"model={SERVED_NAME},base_url={url}/v1,num_concurrent={args.num_concurrent},"
                       "max_retries=2,httpx_trust_env=False")
        results, walls["server"] = lmms_eval("openai", openai_args, args, out / "server",
                                             {**env, "OPENAI_API_KEY": key})
        runs["server"] = (results, out / "server")
        summary = compare(args, runs)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        server.terminate()  # SIGTERM: the server drains and exits
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    report = {"model": args.model, "limit": args.limit, "device": args.device, "dtype": args.dtype,
              "wall_s": {k: round(v, 1) for k, v in walls.items()}, "tasks": summary}
    (out / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'task':<22} {'metric':<12} {'plugin':>8} {'server':>8} {'same replies':>14}")
    equal = True
    for task, e in summary.items():
        plugin = f"{e['plugin']:.4f}" if "plugin" in e else "-"
        same = f"{e['same_replies']}/{e['samples']}" if "same_replies" in e else "-"
        print(f"{task:<22} {e['metric']:<12} {plugin:>8} {e['server']:>8.4f} {same:>14}")
        equal &= "plugin" not in e or (e["plugin"] == e["server"] and e["same_replies"] == e["samples"])
    print(f"[via-server] {out / 'summary.json'} (wall s: {report['wall_s']})")
    if args.check_equal and not equal:
        print("error: the server's scores or replies differ from the plugin's (summary.json: differing)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
