"""The serving benchmark's figures (benchmarks/results/serving.json, written by ``python -m benchmarks.run_all
--record --only serving``): docs/serving.md's table and README's one line, rendered by
scripts/readme_figures.py (spans ``figures:serving`` and ``figures:serving_line``), never typed by hand.
"""
from __future__ import annotations

MODES = (("engine", "engine"), ("sequential", "sequential `generate`"), ("static_batch", "static batch `generate`"))
SOURCE = "`benchmarks/results/serving.json`"


def _tok(x: float) -> str:
    return f"{x:,.0f}"


def _quartiles(st: dict, fmt=_tok, unit: str = "") -> str:
    """``median [q1-q3]`` of a ``benchmarks.harness.stats`` dict."""
    return f"{fmt(st['median'])}{unit} [{fmt(st['q1'])}-{fmt(st['q3'])}]"


def _ratio(x: float) -> str:
    return f"{x:.2f}"


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _c32(run: dict) -> dict:
    """The concurrency-32 row (the issue's throughput target is judged there)."""
    row = next((r for r in run["results"] if r["concurrency"] == 32), None)
    if row is None:
        raise ValueError("serving.json has no concurrency-32 row: record it with the cpu or gpu preset")
    return row


def _throughput_target(run: dict) -> dict:
    """The run's own c=32 target row (its verdict as the run computed it: None on a GPU)."""
    return next(t for t in run["targets"] if t["what"].startswith("tokens/s at concurrency 32"))


def _admission_target(run: dict) -> float:
    """The admission target the run judged its layouts by (issue 41: 1.8x)."""
    return next(t for t in run["targets"] if "admitted" in t["what"])["target"]


def _verdict(met: bool | None) -> str:
    return {True: "met", False: "missed", None: "not judged on this device"}[met]


def _where(run: dict) -> str:
    m, st = run["machine"], run["settings"]
    cpu = m.get("cpu") or "CPU not recorded"
    return (f"{m.get('gpu') or cpu}, {m['usable_cores']} cores, {st['dtype']}, torch threads {st['threads']}; "
            f"commit {m['git']}, load average {m['load_average_1_5_15'][0]:.2f}")


def _split_meets(layouts: list[dict], target: float) -> str:
    meet = [r["layout"] for r in layouts if r["meets_target"]]
    return (f"{', '.join(meet)} reach{'es' if len(meet) == 1 else ''} {target:g}x" if meet
            else f"none reaches {target:g}x")


def render_serving(run: dict) -> str:
    """docs/serving.md's table: tokens/s median [quartiles] per mode and concurrency, the engine over
    sequential ratio per concurrency with its spread, the engine's TTFT and inter-token latencies (its median
    round), the admission plan per layout and the engine-measured peak rows of the run's pair."""
    adm, e = run["admission"], run["admission"]["engine"]
    head = ["concurrency", *(f"{label} tokens/s" for _, label in MODES), "engine / sequential",
            "engine TTFT p50", "engine inter-token p50 / p99"]
    lines = ["| " + " | ".join(head) + " |", "| ---: |" + " ---: |" * (len(head) - 1)]
    for r in run["results"]:
        eng = r["engine"]
        lines.append(f"| {r['concurrency']} | "
                     + " | ".join(_quartiles(r[mode]["tokens_per_s_rounds"]) for mode, _ in MODES)
                     + f" | {_quartiles(r['engine_over_sequential_rounds'], _ratio, 'x')} | {_ms(eng['ttft_p50'])} | "
                       f"{_ms(eng['itl_p50'])} / {_ms(eng['itl_p99'])} |")
    t = _throughput_target(run)
    ratio = _quartiles(_c32(run)["engine_over_sequential_rounds"], _ratio, "x")
    target = _admission_target(run)
    lines += ["", (f"Engine over sequential `generate` at 32 concurrent requests: **{ratio}** (median [quartiles] of "
                   f"the per-round ratios; target >= {t['target']:g}x: {_verdict(t['met'])})."), "",
              (f"| layout, L_E/L_C/L_D of L | KV per {adm['request_len']:,}-token request, MoE / ConceptMoE | "
               f"admitted MoE / ConceptMoE | ratio | bound | >= {target:g}x |"),
              "| --- | ---: | ---: | ---: | ---: | --- |"]
    for r in adm["layouts"]:
        lines.append(f"| {r['layout']}, {r['split']} | {r['moe_bytes'] / 2**20:,.1f} / "
                     f"{r['concept_bytes'] / 2**20:,.1f} MiB | {r['moe_admitted']} / {r['concept_admitted']} | "
                     f"{r['admitted_ratio']:.2f}x | {r['bound']:.2f}x | {'yes' if r['meets_target'] else 'no'} |")
    pair = adm["run_pair"]
    lines += ["", (f"Engine-measured, this run's pair ({pair['pair']}, {pair['split']}; capacity {e['capacity']:,}, "
                   f"budget {e['budget_bytes'] / 2**20:,.1f} MiB = {adm['budget_moe_requests']} MoE requests):"), "",
              "| model | KV per request | planned rows | peak rows (engine) |", "| --- | ---: | ---: | ---: |"]
    for key, name in (("moe", "MoE"), ("concept", "ConceptMoE")):
        lines.append(f"| {name} | {e[key]['bytes_per_request'] / 2**20:,.2f} MiB | {e[key]['planned']} | "
                     f"{e[key]['peak_rows']} |")
    return ("\n" + "\n".join(lines) + f"\n\nPeak rows ConceptMoE / MoE {e['peak_ratio']:.2f}x, "
            + ("equal to the planned counts" if e["matches_plan"] else "NOT the planned counts")
            + f". {run['prompt']}-token prompts, {run['new']} greedy tokens each, the pair's ConceptMoE "
            f"({run['pair']['concept']}); {run['settings']['reps']} interleaved rounds (latencies: the engine's "
            f"median round); {_where(run)} ({SOURCE}).\n")


def render_serving_line(run: dict) -> str:
    """README's one line: the c=32 throughput ratio with its spread and the admission ratios per layout."""
    adm, e = run["admission"], run["admission"]["engine"]
    t = _throughput_target(run)
    ratio = _quartiles(_c32(run)["engine_over_sequential_rounds"], _ratio, "x")
    target = _admission_target(run)
    planned = ", ".join(f"{r['layout']} ({r['split']}) {r['admitted_ratio']:.2f}x" for r in adm["layouts"])
    pair = adm["run_pair"]
    return (f"at 32 concurrent requests the engine decodes **{ratio}** the tokens/s of sequential `generate` (target "
            f"{t['target']:g}x: {_verdict(t['met'])}). Under one KV budget ConceptMoE admits {e['peak_ratio']:.2f}x "
            f"its matched MoE's concurrent {adm['request_len']:,}-token requests (engine-measured, {pair['pair']} "
            f"pair, {pair['split']}); planned by layout (L_E/L_C/L_D of L): {planned}; "
            f"{_split_meets(adm['layouts'], target)}, the encoder and decoder layers keeping full-length caches "
            f"({_where(run)}; {SOURCE})")
