"""CLI of the controlled comparison: plain MoE vs ConceptMoE at equal activated FLOPs and total
parameters, same data order and token budget; resumable per arm and seed (docs/evaluation.md).

    python -m vlm.compare --config configs/compare/cpu.yaml [--seeds N] [--out DIR] [key=value ...]
    python -m vlm.compare --config configs/compare/cpu.yaml --dry-run        # presets + FLOPs table only
    python -m vlm.compare --config configs/compare/cpu.yaml --write-presets  # re-solve configs/model/compare/
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from vlm.compare.config import REPO_ROOT, CompareError, load_compare, rel, repo_path, train_raw
from vlm.compare.data_fit import check_study, fit_line
from vlm.compare.jobs import make_jobs, out_dir, run_job, run_jobs
from vlm.compare.presets import build_presets, seq_len_of
from vlm.compare.report import write_report
from vlm.modeling.config_base import ConfigError


# --- CLI ---------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vlm.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="compare YAML (configs/compare/*.yaml)")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (seed, seed+1, ...); default: the YAML's")
    p.add_argument("--out", default=None, help="output folder (default <output_dir>/<name>)")
    p.add_argument("--jobs", type=int, default=None, help="arms trained at once (subprocesses); 1 = in process")
    p.add_argument("--arms", default=None, help="comma-separated arm ids to run (default: all)")
    p.add_argument("--write-presets", action="store_true",
                   help="rewrite configs/model/compare/<prefix>_*.yaml from a fresh solve")
    p.add_argument("--dry-run", action="store_true", help="solve/check the presets, write the FLOPs table, no training")
    p.add_argument("--fresh", action="store_true", help="retrain even where a finished run with the same key exists")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides of the compare YAML")
    return p.parse_intermixed_args(argv)  # overrides may stand after a flag (--seeds 2 a.b=1)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.worker:
        run_job(json.loads(Path(args.worker).read_text()))
        return 0
    if not args.config:
        print("error: --config is required", file=sys.stderr)
        return 2
    t0 = time.time()
    config = Path(args.config).resolve() if Path(args.config).is_file() else repo_path(args.config)
    out_arg = str(Path(args.out).resolve()) if args.out else None
    if Path.cwd().resolve() != REPO_ROOT:  # train / data / tokenizer paths are relative to the repo root
        os.chdir(REPO_ROOT)
    try:
        cfg = load_compare(config, args.overrides)
        if args.seeds is not None:
            cfg["seeds"] = args.seeds
        if args.arms:
            keep = set(args.arms.split(","))
            if cfg["arms"][0]["id"] not in keep:
                raise CompareError("compare: --arms must include the baseline arm")
            cfg["arms"] = [a for a in cfg["arms"] if a["id"] in keep]
            for a in cfg["arms"]:
                if a["same_as"] and a["same_as"] not in keep:
                    raise CompareError(f"compare: --arms: arm {a['id']} reuses arm {a['same_as']}'s model; keep both")
        weights = (cfg["vlm"].get("vision") or {}).get("pretrained")
        if weights and not repo_path(weights).is_file():  # before any arm trains (make scene-tower builds the study's)
            raise CompareError(f"vision.pretrained: weights file not found: {repo_path(weights)}")
        raw = train_raw(cfg)
        fit = check_study(cfg, raw) if cfg["study"] == "vlm" else []  # before the presets: max_length enters the solve
        for row in fit:
            print(f"[compare] {fit_line(row)}", flush=True)
        presets = build_presets(cfg, raw, mode="write" if args.write_presets else "create")
    except (CompareError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    out = out_dir(cfg, out_arg)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [cfg["seed"] + i for i in range(cfg["seeds"])]
    jobs = make_jobs(cfg, raw, presets, out, seeds)
    results = [] if args.dry_run else run_jobs(jobs, args.jobs or cfg["jobs"], fresh=args.fresh,
                                                  isolate=bool(cfg["isolate"]))
    if cfg["study"] == "vlm":
        report = _vlm_report(cfg, raw, presets, results, out, seeds, t0, fit)
    else:
        report = write_report(cfg, raw, presets, results, out, seq_len=seq_len_of(cfg, raw), seeds=seeds,
                              wall_s=time.time() - t0)
    print(report["markdown_tables"], flush=True)
    print(f"[compare] report: {rel(out / 'report.md')} ({time.time() - t0:.0f} s)", flush=True)
    return 0 if report["match_ok"] else 1


def _vlm_report(cfg: dict, raw: dict, presets: dict, results: list[dict], out: Path, seeds: list[int],
                t0: float, fit: list[dict]) -> dict:
    """The VLM study's report: the seed-0 exports probed side by side (prefill, concepts), every run's
    export measured for image use (vlm.compare.image_use), then written."""
    import torch

    from vlm.compare.image_use import measure_runs
    from vlm.compare.vlm_probe import probe
    from vlm.compare.vlm_report import write_vlm_report

    probed, used = None, None
    e, before = cfg["eval"], torch.get_num_threads()
    vqa_json, image_root = str(repo_path(raw["eval"]["vqa_json"])), str(repo_path(raw["eval"]["image_root"]))
    first = {r["arm"]: Path(r["run_dir"]) / "hf" for r in results if r["seed"] == seeds[0]}
    if cfg["threads"]:
        torch.set_num_threads(int(cfg["threads"]))
    try:
        if first and all((hf / "config.json").is_file() for hf in first.values()):
            probed = probe({a: str(hf) for a, hf in sorted(first.items())}, vqa_json, image_root,
                           int(e["prefill_batch"]), int(e["prefill_reps"]), int(e["pictures"]), out / "pictures")
        if results and e["image_use"]:
            used = measure_runs(results, vqa_json, image_root, int(e["image_use"]))
    finally:
        torch.set_num_threads(before)
    return write_vlm_report(cfg, raw, presets, results, out, seq_len_of(cfg, raw), seeds, time.time() - t0, probed,
                            used, fit)

if __name__ == "__main__":
    sys.exit(main())
