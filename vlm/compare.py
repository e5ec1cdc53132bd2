"""Controlled comparison: plain MoE vs ConceptMoE (dynamic / fixed chunking, looping) at equal
activated FLOPs and equal total parameters, same data order, same token budget.

    python -m vlm.compare --config configs/compare/cpu.yaml [--seeds N] [--out DIR] [key=value ...]
    python -m vlm.compare --config configs/compare/cpu.yaml --dry-run       # presets + FLOPs table only
    python -m vlm.compare --config configs/compare/cpu.yaml --write-presets # re-solve configs/model/cmp_*

What it does (paper sections 7-8, see docs/conceptmoe.md):
1. Builds the plain-MoE baseline language model of the compare YAML (``baseline``; its vocabulary
   size is taken from the tokenizer so the accounting is that of the trained model) and solves
   each ConceptMoE arm against it with ``vlm.flop_matching.solve_match`` (strategy ``topk`` = 1,
   ``loop`` = 2, ``wide`` = 3). The language-model presets are written with the solver's YAML
   writer as ``configs/model/<prefix>_<arm>_lm.yaml`` and the VLM presets (shared vision tower +
   projector, ``text_preset:`` the LM preset, plus the arm's ``text:`` overrides, e.g.
   ``boundary_mode: fixed``) as ``configs/model/<prefix>_<arm>.yaml``. Existing presets are
   checked against a fresh solve: a stale one is an error (``--write-presets`` rewrites it).
2. Trains every arm for every seed with the project's ``Trainer`` on the same training YAML (the
   compare YAML's ``train_base`` + ``train``): same steps, micro-batch, sequence length and data
   seed, so the same sample order and token budget (checked: a fingerprint of every batch's token
   ids is recorded per run and must agree across the arms of a seed). Seed s sets both the data
   order and the initialisation: arms of one seed are paired.
3. Evaluates the exported HF model: held-out digits VQA (the trainer's ``eval`` section, with the
   achieved compression ratio on the prompts, pooled and per modality) and held-out text
   (``eval_suites.text_eval``: loss per token, bits per byte, achieved ratio) on a bounded number
   of tokens.
4. Writes ``<out>/report.md`` + ``report.json`` + ``loss_curves.png`` (``vlm/compare_report.py``).

Runs are resumable: an arm/seed whose ``compare_result.json`` carries the same job key (train
config + eval settings + preset texts) is reused, so ``--seeds 3`` after a 1-seed run trains only
the new seeds (``--fresh`` retrains everything; the key does not cover code changes). ``jobs: N``
(or ``--jobs``) trains N arms at once in subprocesses (``threads`` torch threads each); ``jobs: 1``
trains them one after the other in this process, or each in its own subprocess with
``isolate: true`` (GPU: a fresh CUDA context per arm).

Compare YAML keys (see configs/compare/cpu.yaml for a commented example): name, output_dir, seed,
seeds, jobs, threads, isolate, preset_prefix, train_base, train (train-YAML keys; model.* is owned
by the arms), vlm (vision / projector / text shared by all arms), baseline (preset and/or lm
sections of arm a's language model), match (solve_match options), arms (id, name, label, solve:
null|topk|loop|wide, solve_opts, same_as: an earlier arm's LM, text: VLM text overrides), eval
(text, text_max_tokens, text_seq_len, text_batch_size, dtype, keep_hf).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from vlm.compare_config import (  # noqa: F401 - re-exported: the compare API in one place
    REPO_ROOT,
    CompareError,
    _path,
    _rel,
    _seq_len,
    build_presets,
    load_compare,
    train_raw,
)
from vlm.compare_jobs import make_jobs, out_dir, run_job, run_jobs  # noqa: F401


# --- CLI ---------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vlm.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="compare YAML (configs/compare/*.yaml)")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (seed, seed+1, ...); default: the YAML's")
    p.add_argument("--out", default=None, help="output folder (default <output_dir>/<name>)")
    p.add_argument("--jobs", type=int, default=None, help="arms trained at once (subprocesses); 1 = in process")
    p.add_argument("--arms", default=None, help="comma-separated arm ids to run (default: all)")
    p.add_argument("--write-presets", action="store_true",
                   help="rewrite configs/model/<prefix>_*.yaml from a fresh solve")
    p.add_argument("--dry-run", action="store_true", help="solve/check the presets, write the FLOPs table, no training")
    p.add_argument("--fresh", action="store_true", help="retrain even where a finished run with the same key exists")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides of the compare YAML")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.worker:
        run_job(json.loads(Path(args.worker).read_text()))
        return 0
    if not args.config:
        print("error: --config is required", file=sys.stderr)
        return 2
    from vlm.compare_report import write_report
    from vlm.config import ConfigError

    t0 = time.time()
    config = Path(args.config).resolve() if Path(args.config).is_file() else _path(args.config)
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
        raw = train_raw(cfg)
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
    report = write_report(cfg, raw, presets, results, out, seq_len=_seq_len(cfg, raw), seeds=seeds,
                          wall_s=time.time() - t0)
    print(report["markdown_tables"], flush=True)
    print(f"[compare] report: {_rel(out / 'report.md')} ({time.time() - t0:.0f} s)", flush=True)
    return 0 if report["match_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
