"""The headline figures of README.md and docs/*.md, rendered from the files a run writes, never typed by hand.

    make train-vlm && make eval EVAL_ARGS="--name train-vlm"
    python scripts/readme_figures.py --publish runs/train-vlm --eval runs/eval/train-vlm [--commit SHA]
    python scripts/readme_figures.py --bench      # after make bench RECORD=1: the tables from benchmarks/results/
    python scripts/readme_figures.py --check      # exit 1 when a page differs from those files

``--publish`` copies the run's ``summary.json`` (written by ``make train-vlm``) and the eval's
``results.json`` (written by ``make eval``) unchanged into ``docs/results/train-vlm/``, with ``run.json``
(the run's commit, whether this tree's code / configs differ from it, date, CPU count, the model's target
R), then rewrites every span between ``<!-- figures:KEY -->`` and ``<!-- /figures -->`` of README.md and
docs/*.md (each KEY marked once over all pages) from those files and from ``benchmarks/results/``
(``prefill.json``, ``decode.json``: written by ``make bench RECORD=1``; ``vs_transformers.json`` and
``vs_transformers_8K.json``: written by ``python -m benchmarks.vs_transformers --record``; ``overhead.json``: written by
``python -m benchmarks.overhead --record``; ``inference.json``: written by ``python -m benchmarks.inference --record``;
``serving.json``: written by ``python -m benchmarks.run_all --record --only serving``, rendered by
scripts/figures_serving.py), ``docs/results/tests/unit.json`` (``scripts/test_timing.py unit``) and
``docs/results/compare_vlm/report.json`` (``make compare-vlm``'s report, rendered by scripts/figures_vlm_study.py). ``--check`` (and
tests/unit/tools/test_readme_figures.py) compares.
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
if str(ROOT) not in sys.path:  # run as a script file
    sys.path.insert(0, str(ROOT))
from scripts.figures_serving import render_serving, render_serving_line
from scripts.figures_vlm_study import render_vlm_study_line

RESULTS = ROOT / "docs" / "results" / "train-vlm"
README = ROOT / "README.md"
BENCH = ROOT / "benchmarks" / "results"
TESTS = ROOT / "docs" / "results" / "tests"
STUDIES = ROOT / "docs" / "results" / "compare_vlm"
RUN_INPUTS = ("vlm", "data_pipelines", "vision_encoders", "configs", "Makefile", "pyproject.toml")
SPAN = re.compile(r"<!-- figures:(\w+) -->(.*?)<!-- /figures -->", re.DOTALL)


NO_CPU = "CPU not recorded"  # a result file written before the writers recorded the CPU model


def _cpu(machine: dict | None) -> str:
    """The CPU model a result file records (its ``machine.cpu`` / ``cpu``), else NO_CPU."""
    return (machine or {}).get("cpu") or NO_CPU


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def render_train(summary: dict, run: dict) -> str:
    """The demo's sentence: accuracy (+ breakdown), eval R, throughput and wall time, where from."""
    ev = summary["eval"]
    parts = ", ".join(f"{kind.replace('_', '-')} {acc:.0%}" for kind, acc in ev["by_kind"].items())
    dirty = ", uncommitted changes" if run["dirty"] else ""
    where = summary.get("machine") or {}
    return (f"Last run (commit {run['commit'][:7]}{dirty}, {_cpu(where)}, {where.get('cpu_count') or run['cpu_count']} "
            "cores; "
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


def _spread(speedup: dict) -> str:
    return (f"{speedup['median_of_ratios']:+.1%} [{speedup['ratio_q1'] * 100:+.1f}, "
            f"{speedup['ratio_q3'] * 100:+.1f}]")


def render_bench(prefill: dict, decode: dict) -> str:
    """The README's result table: prefill and decode speedups per length, median [IQR] of per-round ratios."""
    sizes = prefill["settings"]["sizes"]
    by_len = {r["seq_len"]: r for r in prefill["results"]}
    by_batch_len = {(r["batch"], r["kv_len"]): r for r in decode["results"]}
    rows = [("prefill speedup, median [IQR]", [_spread(by_len[n]["speedup"]) for n in sizes]),
            ("prefill, predicted by the accountant (causal map)",
             [f"{by_len[n]['predicted_speedup_causal']:+.1%}" for n in sizes])]
    rows += [(f"decode speedup per step, batch {b}, median [IQR]",
              [_spread(by_batch_len[(b, n)]["speedup"]) for n in sizes]) for b in decode["batches"]]
    head = [f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}" for n in sizes]
    lines = ["| ConceptMoE vs matched MoE (fixed boundaries, R = 2) | " + " | ".join(head) + " |",
             "| --- |" + " ---: |" * len(sizes)]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    pm, dm = prefill["machine"], decode["machine"]
    source = (f"{_cpu(pm)}, {pm['usable_cores']} cores, {prefill['settings']['dtype']}, torch threads "
              f"{prefill['settings']['threads']}; prefill {prefill['settings']['reps']} and decode "
              f"{decode['settings']['reps']} interleaved rounds; commit {pm['git']} / {dm['git']}, load average "
              f"{pm['load_average_1_5_15'][0]:.2f} / {dm['load_average_1_5_15'][0]:.2f} "
              f"(`benchmarks/results/prefill.json`, `decode.json`).")
    return "\n" + "\n".join(lines) + "\n\n" + source + "\n"


VS_HF_TARGETS = (  # (label, target, cell getter over one family's results of one file)
    ("training step time, ours (full loss) / transformers", 0.90,
     lambda fam: fam["train"][0]["vs_hf"]["ours_full"]["time_ratio"]),
    ("training step peak resident memory, ours / transformers", 1.0,
     lambda fam: fam["train"][0]["vs_hf"]["ours_full"]["peak_ratio"]),
)
VS_HF_DECODE = ("decode per step at batch 8, ours / transformers' StaticCache", 0.90)
VS_HF_KV = ("R = 2 model: allocated concept-layer KV / plain model's same layers", 0.6)


def _verdict(values: dict[str, float], target: float) -> str:
    met = [f for f, v in values.items() if v <= target]
    if len(met) == len(values):
        return "met"
    return "missed" if not met else "met for " + ", ".join(met) + ", missed for " + \
        ", ".join(f for f in values if f not in met)


def render_vs_transformers(runs: list[dict]) -> str:
    """docs/performance.md's target table: ours vs transformers on the same weights, per training length
    (one results file each) and the decode / KV rows of the file that has them; verdicts from the
    exact ratios (the cells are rounded)."""
    families = list(runs[0]["results"])
    names = {"olmoe": "OLMoE", "qwen3_moe": "Qwen3-MoE"}
    lines = ["| target | " + " | ".join(names.get(f, f) for f in families) + " | verdict |",
             "| --- |" + " ---: |" * len(families) + " --- |"]

    def row(label, target, values, fmt="{:.3f}x"):
        bound = f"{target:.2f}x" if fmt.endswith("x") else f"{target:g}"
        lines.append(f"| {label} (<= {bound}) | "
                     + " | ".join(fmt.format(v) for v in values.values()) + f" | {_verdict(values, target)} |")
    sources = []
    for run in runs:
        T = run["results"][families[0]]["train"][0]["seq_len"]
        for label, target, get in VS_HF_TARGETS:
            row(f"{label}, {T // 1024}K tokens", target, {f: get(run["results"][f]) for f in families})
        decode = {f: [d for d in run["results"][f]["decode"] if d["batch"] == 8] for f in families}
        if all(decode.values()):
            row(VS_HF_DECODE[0], VS_HF_DECODE[1],
                {f: d[0]["decode"]["vs_hf_static"]["ours"]["time_ratio"] for f, d in decode.items()})
            row(VS_HF_KV[0], VS_HF_KV[1], {f: d[0]["R2_concept_allocated_over_plain"] for f, d in decode.items()},
                fmt="{:.3f}")
        m, st = run["machine"], run["settings"]
        sources.append(f"{T // 1024}K: commit {m['git']}, {st['reps']} interleaved rounds, load average "
                       f"{m['load_average_1_5_15'][0]:.2f}")
    tag = {2048: "", 8192: "_8K"}
    files = ", ".join(f"`benchmarks/results/vs_transformers{tag.get(r['settings']['sizes'][0], '')}.json`"
                      for r in runs)
    return ("\n" + "\n".join(lines) + f"\n\n{_cpu(runs[0]['machine'])}, {runs[0]['settings']['dtype']}, torch threads "
            f"{runs[0]['settings']['threads']}; " + "; ".join(sources) + f" ({files}).\n")


def render_tests(unit: dict) -> str:
    """README's unit-tier time, with the machine's load (docs/results/tests/unit.json, scripts/test_timing.py)."""
    minutes, seconds = divmod(round(unit["wall_s"]), 60)
    return (f"{unit.get('passed', 0):,} passed in {minutes} min {seconds:02d} s on {_cpu(unit)}, {unit['cpu_count']} cores, load "
            f"average {unit['load_before']:.1f} at the start (commit {unit['commit']}, "
            "`docs/results/tests/unit.json`)")


OVERHEAD_MODELS = {"conceptmoe": "ConceptMoE", "moe": "plain MoE twin", "transformers": "transformers Qwen3-MoE"}


def render_overhead(run: dict) -> str:
    """docs/performance.md's host-overhead table (benchmarks/results/overhead.json, benchmarks/overhead.py)."""
    res = run["results"]
    lines = ["| model | ops per step | forward | backward | optimizer step | syncs named / unnamed | graph breaks |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key, name in OVERHEAD_MODELS.items():
        r = res[key]
        ph = r["ops_by_phase"]
        gb = r["graph_breaks"]
        breaks = "n/a" if gb is None else ("does not trace" if gb.get("error") else str(gb["breaks"]))
        lines.append(f"| {name} | {r['ops']:,} | {ph.get('forward', 0):,} | {ph.get('backward', 0):,} | "
                     f"{ph.get('optimizer step', 0):,} | {sum(r['named_syncs'].values())}"
                     + (f" ({r['named_syncs_cpu_only']} CPU-only)" if r.get("named_syncs_cpu_only") else "")
                     + f" / {len(r['unnamed_syncs'])} | "
                     f"{breaks} |")
    lines += ["", "| target | ConceptMoE | plain MoE twin | verdict |", "| --- | ---: | ---: | --- |"]
    whats = list(dict.fromkeys(t["what"] for t in run["targets"]))
    for what in whats:
        cells = {t["model"]: t for t in run["targets"] if t["what"] == what}
        fmt = lambda t: f"{t['value']:.2f}x" if isinstance(t["value"], float) else str(t["value"])  # noqa: E731
        verdict = "met" if all(t["met"] for t in cells.values()) else \
            "missed" if not any(t["met"] for t in cells.values()) else \
            "met for " + ", ".join(OVERHEAD_MODELS[k] for k, t in cells.items() if t["met"])
        lines.append(f"| {what} | {fmt(cells['conceptmoe'])} | {fmt(cells['moe'])} | {verdict} |")
    m, st = run["machine"], run["settings"]
    return ("\n" + "\n".join(lines) + f"\n\n{run['tokens']} tokens in {run['docs']} packed documents, "
            f"{run['layers']} layers at width {run['width']['hidden_size']}; {_cpu(m)}, {st['dtype']}, torch threads "
            f"{st['threads']}; commit {m['git']}, load average {m['load_average_1_5_15'][0]:.2f} "
            "(`benchmarks/results/overhead.json`).\n")


INFERENCE_MODES = {"ours": "ours, plain MoE", "ours_compiled": "ours, plain MoE, compiled decode",
                   "ours_cudagraph": "ours, plain MoE, CUDA-graph decode", "ours_R2": "ours, ConceptMoE R = 2 (converted)",
                   "hf_static": "transformers StaticCache", "hf_static_compiled": "transformers StaticCache + compile"}


def render_inference(run: dict) -> str:
    """docs/performance.md's which-to-pick table (benchmarks/results/inference.json, benchmarks/inference.py):
    times as ratios to transformers' compiled path from the same rounds, ops and syncs per decode step,
    the targets' verdicts as the run computed them."""
    pre, dec, counts = (run["results"][k] for k in ("prefill", "decode", "counts"))
    names = {n: INFERENCE_MODES.get(n, n) for n in run["modes"]}
    batches = list(counts)

    def cell(r, n, key, fmt):
        if n not in r[key]:
            return "did not run" if n in r["failed"] else "= eager"
        ratio = r["vs_reference"].get(n)
        return fmt(r[key][n]) + (f" ({ratio['median']:.2f}x)" if ratio else "")
    head = ([f"prefill {r['prompt']:,}" for r in pre] + [f"decode B={r['batch']}, KV {r['kv_len']:,}" for r in dec]
            + [f"ops per step (B={' / '.join(batches)})", "syncs per step"])
    lines = ["| mode | " + " | ".join(head) + " |", "| --- |" + " ---: |" * len(head)]
    for n, label in names.items():
        c = [counts[b].get(n) for b in batches]
        cells = ([cell(r, n, "median_s", lambda t: f"{t:.3g} s" if t >= 1 else f"{t * 1e3:.3g} ms") for r in pre]
                 + [cell(r, n, "ms_per_step", lambda t: f"{t:.3g} ms") for r in dec]
                 + [" / ".join(f"{x['ops_per_step']:,.0f}" if x else "n/a" for x in c),
                    " / ".join(f"{x['syncs_per_step']:.2f}" if x else "n/a" for x in c)])
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "| target (issue 35) | value | verdict |", "| --- | ---: | --- |"]
    for t in run["targets"]:
        where = f"B={t['batch']}" + (f", KV {t['kv_len']:,}" if "kv_len" in t else "")
        value = "n/a" if t["value"] is None else f"{t['value']:.3g}"
        verdict = "not measured on this device" if t["met"] is None else "met" if t["met"] else "missed"
        lines.append(f"| {names[t['mode']]}, {where}: {t['what']} | {value} | {verdict} |")
    failed = sorted({f"{names[n]} ({kind}): {why}" for kind, rs in (("prefill", pre), ("decode", dec))
                     for r in rs for n, why in r["failed"].items()})
    def refs(rows):
        return " / ".join(names.get(r, str(r)) for r in dict.fromkeys(r["reference"] for r in rows))
    m, st, sh = run["machine"], run["settings"], run["shape"]
    return ("\n" + "\n".join(lines) + "\n\n"
            + ("Did not run: " + "; ".join(failed) + ".\n\n" if failed else "")
            + f"Times (ratio to {refs(pre)} for the prefill, to {refs(dec)} for decode; '= eager': transformers' "
            "generate runs its prefill eager); Qwen3-MoE with "
            f"{sh['num_hidden_layers']} layers, hidden {sh['hidden_size']}, {sh['num_experts']} experts top-"
            f"{sh['num_experts_per_tok']}; {m.get('gpu') or _cpu(m)}, {st['dtype']}, torch threads {st['threads']}, "
            f"{st['reps']} interleaved rounds; commit {m['git']}, load average {m['load_average_1_5_15'][0]:.2f} "
            "(`benchmarks/results/inference.json`).\n")


def rendered(results_dir: Path = RESULTS) -> dict[str, str]:
    """The demo run's figures (docs/results/train-vlm/)."""
    def load(name):
        return json.loads((results_dir / name).read_text(encoding="utf-8"))

    return {"train": render_train(load("summary.json"), load("run.json")), "eval": render_eval(load("results.json"))}


def rendered_bench(bench_dir: Path = BENCH) -> dict[str, str]:
    """The benchmark table's figures (benchmarks/results/, written by make bench)."""
    def load(name):
        return json.loads((bench_dir / name).read_text(encoding="utf-8"))

    serving = load("serving.json")
    vs_hf = [load(name) for name in ("vs_transformers.json", "vs_transformers_8K.json") if (bench_dir / name).exists()]
    return {"bench": render_bench(load("prefill.json"), load("decode.json")), "vs_transformers": render_vs_transformers(vs_hf),
            "overhead": render_overhead(load("overhead.json")), "inference": render_inference(load("inference.json")),
            "serving": render_serving(serving), "serving_line": render_serving_line(serving)}


def rendered_tests(tests_dir: Path = TESTS) -> dict[str, str]:
    """The unit tier's time (docs/results/tests/unit.json, written by scripts/test_timing.py)."""
    return {"tests": render_tests(json.loads((tests_dir / "unit.json").read_text(encoding="utf-8")))}


def rendered_studies(vlm_dir: Path = STUDIES) -> dict[str, str]:
    """The VLM study's headline (docs/results/compare_vlm/report.json, copied from make compare-vlm's report)."""
    return {"vlm_study_line": render_vlm_study_line(json.loads((vlm_dir / "report.json").read_text(encoding="utf-8")))}


def all_figures() -> dict[str, str]:
    return {**rendered(), **rendered_bench(), **rendered_tests(), **rendered_studies()}


def pages() -> list[Path]:
    """README.md and the docs/ pages (not the run reports under docs/results/)."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def readme_spans(text: str) -> dict[str, str]:
    spans = {}
    for match in SPAN.finditer(text):
        if match.group(1) in spans:
            raise ValueError(f"README: figures:{match.group(1)} marked twice")
        spans[match.group(1)] = match.group(2)
    return spans


def page_spans() -> dict[str, str]:
    """Every page's spans; a KEY marked on two pages is an error."""
    spans, where = {}, {}
    for page in pages():
        for key, text in readme_spans(page.read_text(encoding="utf-8")).items():
            if key in spans:
                raise ValueError(f"figures:{key} marked in {where[key]} and {page.relative_to(ROOT)}")
            spans[key], where[key] = text, page.relative_to(ROOT)
    return spans


def rewrite(text: str, figures: dict[str, str]) -> str:
    missing = set(figures) - set(readme_spans(text))
    if missing:
        raise ValueError(f"README: no <!-- figures:{min(missing)} --> span")
    return SPAN.sub(lambda m: f"<!-- figures:{m.group(1)} -->{figures[m.group(1)]}<!-- /figures -->", text)


def rewrite_pages(figures: dict[str, str]) -> list[Path]:
    """Rewrite every span of every page; the pages that changed."""
    missing = set(figures) - set(page_spans())
    if missing:
        raise ValueError(f"no page has a <!-- figures:{min(missing)} --> span")
    changed = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        new = SPAN.sub(lambda m: f"<!-- figures:{m.group(1)} -->{figures[m.group(1)]}<!-- /figures -->", text)
        if new != text:
            page.write_text(new, encoding="utf-8")
            changed.append(page)
    return changed


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
    ap.add_argument("--bench", action="store_true", help="rewrite the spans from the committed files only "
                                                         "(after make bench RECORD=1 wrote benchmarks/results/)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a page differs from the files (the default)")
    args = ap.parse_args(argv)
    if bool(args.publish) != bool(args.eval) or (args.check and (args.publish or args.bench)):
        ap.error("give --publish RUN --eval EVAL, --bench, or --check")
    if args.publish:
        publish(args.publish, args.eval, args.commit)
    if args.publish or args.bench:
        changed = rewrite_pages(all_figures())
        print(f"[figures] {RESULTS.relative_to(ROOT)}, {BENCH.relative_to(ROOT)} -> "
              f"{', '.join(str(p.relative_to(ROOT)) for p in changed) or 'no page changed'}")
        return 0
    spans = page_spans()
    stale = [key for key, value in all_figures().items() if spans.get(key) != value]
    if stale:
        print(f"error: figures {stale} differ from docs/results/train-vlm/ or benchmarks/results/: run --publish "
              f"or --bench", file=sys.stderr)
        return 1
    print("[figures] README.md and docs/*.md match docs/results/train-vlm/ and benchmarks/results/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
