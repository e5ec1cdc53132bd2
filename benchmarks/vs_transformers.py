"""Ours vs transformers on the same weights: small OLMoE and Qwen3-MoE built with transformers' classes,
imported (``vlm.hf_import``), timed side by side; the converted R = 2 ConceptMoE beside them.

Per family: training step (forward + backward; ours with the full-logits loss and with the chunked
loss), prefill, and decode at batch 1 and 8 against transformers with ``grouped_mm`` experts and
sdpa, with its ``DynamicCache`` and its ``StaticCache``. Times and peak memory are ratios ours /
transformers from the same interleaved rounds (benchmarks/harness.py). The converted model reports
its achieved R on the prompt and on the generated tokens and its allocated vs held KV bytes.

    python -m benchmarks.vs_transformers [--device cuda] [--sizes 2K,8K] [--families olmoe] [--smoke]
        [--parts train,decode] [--train-variants ours_full,ours_chunked,ours_R2]

A CPU training step at 8K tokens takes ~8x the 2K one (attention grows quadratically): ``--parts train``
and fewer ``--train-variants`` keep a long-sequence run short.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from benchmarks.cli import base_parser, logger, setup
from benchmarks.harness import free_memory, interleaved, peak_memory_interleaved
from benchmarks.hf_pair import FAMILIES, SHAPES, build_hf, kv_bytes_hf, kv_bytes_ours, load_hf, load_ours
from benchmarks.model_pair import random_ids
from benchmarks.report import finish, fmt_bytes, fmt_time, md_table, settings_line, write_results

NAME = "vs_transformers"
PRESETS = {"smoke": [32], "cpu": [2048], "gpu": [2048, 8192]}  # training sequence lengths (batch 1)
REPS = {"smoke": 1, "cpu": 3, "gpu": 5}
PROMPT = {"smoke": 32, "cpu": 512, "gpu": 2048}  # prefill / decode prompt length
STEPS = {"smoke": 2, "cpu": 8, "gpu": 32}  # decode steps per measurement
TRAIN = ("hf", "ours_full", "ours_chunked", "ours_R2")
DECODE = ("hf_dynamic", "hf_static", "ours", "ours_R2")


def _ratio_cells(comp, peaks, names, base) -> dict:
    """ours / transformers: median of per-round time ratios, and the ratio of peak-memory medians."""
    out = {}
    for n in names:
        if n == base:
            continue
        per_round = sorted(a / b for a, b in zip(comp.times[n], comp.times[base]))
        out[n] = {"time_ratio": per_round[len(per_round) // 2],
                  "peak_ratio": (peaks[n]["bytes"] / peaks[base]["bytes"]) if peaks and peaks[base]["bytes"] else None}
    return out


def bench_train(models, hf, ids, s, log, names=TRAIN) -> dict:
    def step(fn, params):
        def run():
            for p in params:
                p.grad = None
            fn().backward()
        return run
    plain, con = models
    variants = {
        "hf": step(lambda: hf(input_ids=ids, labels=ids).loss, list(hf.parameters())),
        "ours_full": step(lambda: plain(input_ids=ids, labels=ids, return_logits=True).loss, list(plain.parameters())),
        "ours_chunked": step(lambda: plain(input_ids=ids, labels=ids, return_logits=False).loss,
                             list(plain.parameters())),
        "ours_R2": step(lambda: con(input_ids=ids, labels=ids, return_logits=False).loss, list(con.parameters())),
    }
    variants = {n: f for n, f in variants.items() if n in names}
    for m in (hf, plain, con):
        m.train()
    comp = interleaved(variants, s.device, s.reps, s.warmup, log=log)
    peaks = peak_memory_interleaved(variants, s.device, n=max(1, min(3, s.reps)))
    ratio = None
    if "ours_R2" in variants:
        with torch.no_grad():
            ratio = float(con(input_ids=ids, labels=ids, return_logits=False).compression["ratio"])
    for m in (hf, plain, con):
        m.eval()
        m.zero_grad(set_to_none=True)
    return {"times": comp.times, "median_s": {n: comp.median(n) for n in variants},
            "peak_bytes": {n: peaks[n]["bytes"] for n in variants}, "peak_method": peaks["hf"]["method"],
            "vs_hf": _ratio_cells(comp, peaks, variants, "hf"), "R2_achieved_ratio": ratio}


def _hf_prefill(hf, ids, cache):
    return hf(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]


def bench_decode(models, hf, B, P, steps, s, log) -> dict:
    """Prefill (timed, fresh caches) and ``steps`` decode steps per measurement, fed random tokens (the
    same sequence for every variant; a repeated token would make the router's boundaries, hence the
    R2 model's achieved R, degenerate); the caches keep growing over the rounds, capacity for all."""
    from transformers import DynamicCache, StaticCache

    plain, con = models
    cap = P + steps * (s.warmup + s.reps + 1) + 2
    ids = random_ids(B, P, plain.config.vocab_size, s.device, seed=P + B)
    fed = random_ids(B, cap - P, plain.config.vocab_size, s.device, seed=7)  # token fed at position P + i
    caches = {}

    def prefill(tag):
        def run():
            if tag == "hf_dynamic":
                caches[tag] = DynamicCache(config=hf.config)
                return _hf_prefill(hf, ids, caches[tag])
            if tag == "hf_static":
                caches[tag] = StaticCache(config=hf.config, max_cache_len=cap)
                return _hf_prefill(hf, ids, caches[tag])
            m = plain if tag == "ours" else con
            caches[tag] = m.start_decoding(B, cap)
            return m.prefill(caches[tag], ids)
        return run
    with torch.inference_mode():
        pre = {t: prefill(t) for t in DECODE}
        comp_p = interleaved(pre, s.device, s.reps, s.warmup)
        peaks_p = peak_memory_interleaved(pre, s.device, n=1)
        first = {t: pre[t]() for t in DECODE}  # the caches every decode measurement continues
        gap = max(float((first[t] - first["ours"]).abs().max()) for t in ("hf_dynamic", "hf_static"))
        prompt_concepts = float(con._last_prefill.num_concepts_B.float().mean())
        con_entries0 = int(caches["ours_R2"].concept_caches[0].num_entries().max())
        pos = {t: P for t in DECODE}

        def decode(tag):
            def run():
                for _ in range(steps):
                    tok = fed[:, pos[tag] - P:pos[tag] - P + 1]
                    if tag.startswith("hf"):
                        position = torch.full((B, 1), pos[tag], device=s.device)
                        hf(input_ids=tok, cache=caches[tag], position_ids=position, use_cache=True)
                    else:
                        (plain if tag == "ours" else con).step(caches[tag], tok[:, 0])
                    pos[tag] += 1
            return run
        dec = {t: decode(t) for t in DECODE}
        at_P = torch.full((B, 1), P, device=s.device)
        step_gap = float((hf(input_ids=fed[:, :1], cache=caches["hf_static"], position_ids=at_P,
                             use_cache=True).logits[:, -1] - plain.step(caches["ours"], fed[:, 0])).abs().max())
        pos["hf_static"] += 1
        pos["ours"] += 1
        comp_d = interleaved(dec, s.device, s.reps, s.warmup)
    generated = pos["ours_R2"] - P
    con_entries = int(caches["ours_R2"].concept_caches[0].num_entries().max())
    kv = {t: (kv_bytes_hf(caches[t]) if t.startswith("hf") else kv_bytes_ours(caches[t])) for t in DECODE}
    plain_same_layers = kv["ours"]["token"]["allocated_bytes"] / kv["ours"]["token"]["layers"] \
        * kv["ours_R2"]["concept"]["layers"]
    res = {"batch": B, "prompt": P, "steps_per_measurement": steps, "capacity": cap,
           "prefill": {"times": comp_p.times, "median_s": {t: comp_p.median(t) for t in DECODE},
                       "peak_bytes": {t: peaks_p[t]["bytes"] for t in DECODE}},
           "decode": {"times": comp_d.times, "median_s_per_step": {t: comp_d.median(t) / steps for t in DECODE}},
           "prefill_logit_gap_vs_hf": gap, "decode_logit_gap_vs_hf_static": step_gap,
           "R2_prompt_ratio": P / prompt_concepts,
           "R2_generated_ratio": generated / max(con_entries - con_entries0, 1), "kv": kv,
           "R2_concept_allocated_over_plain": kv["ours_R2"]["concept"]["allocated_bytes"] / plain_same_layers,
           "R2_concept_held_over_plain": kv["ours_R2"]["concept"]["held_bytes"] / plain_same_layers}
    for stage, comp in (("prefill", comp_p), ("decode", comp_d)):
        res[stage]["vs_hf_dynamic"] = _ratio_cells(comp, None, DECODE, "hf_dynamic")
        res[stage]["vs_hf_static"] = _ratio_cells(comp, None, DECODE, "hf_static")
    log(f"B={B} P={P}: decode per step " + ", ".join(f"{t} {fmt_time(v)}" for t, v in
                                                      res["decode"]["median_s_per_step"].items()))
    return res


def run(argv=None) -> dict:
    ap = base_parser(NAME, __doc__.split("\n")[0], "training sequence lengths, e.g. 2K,8K")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--batches", default=None, help="decode batch sizes (default 1,8; smoke 1,2)")
    ap.add_argument("--prompt", type=int, default=None, help="prefill / decode prompt length")
    ap.add_argument("--ratio", type=float, default=2.0, help="the converted ConceptMoE's target R")
    ap.add_argument("--parts", default="train,decode", help="comma list of train, decode")
    ap.add_argument("--train-variants", default=",".join(TRAIN[1:]),
                    help=f"training variants timed against transformers (comma list of {', '.join(TRAIN[1:])})")
    args = ap.parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    names = ("hf",) + tuple(n.strip() for n in args.train_variants.split(",") if n.strip())
    bad = (parts - {"train", "decode"}) | (set(names) - set(TRAIN))
    if bad:
        ap.error(f"unknown --parts / --train-variants: {', '.join(sorted(bad))}")
    s = setup(NAME, args, PRESETS, REPS)
    log = logger(s)
    import transformers
    transformers.utils.logging.disable_progress_bar()
    preset = s.preset if s.preset in SHAPES else ("gpu" if s.is_cuda else "cpu")
    shape = SHAPES["smoke" if s.smoke else preset]
    P = args.prompt or PROMPT["smoke" if s.smoke else preset]
    steps = STEPS["smoke" if s.smoke else preset]
    batches = [int(b) for b in (args.batches or ("1,2" if s.smoke else "1,8")).split(",")]
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    results = {}

    def report():
        return {"shape": shape, "prompt": P, "batches": batches, "ratio": args.ratio,
                "transformers": transformers.__version__, "results": results}, markdown(results, s, shape, args.ratio)

    with tempfile.TemporaryDirectory() as tmp:
        for fam in families:
            src = build_hf(fam, shape, Path(tmp) / fam, max(max(s.sizes), P + 1024), seed=s.seed)
            hf = load_hf(fam, src, s.device, s.dtype).eval()
            models = load_ours(src, Path(tmp) / f"{fam}_R{args.ratio:g}", args.ratio, s.device, s.dtype, s.seed)
            fam_res = {"train": [], "decode": []}
            results[fam] = fam_res
            for T in (s.sizes if "train" in parts else []):
                log(f"{fam}: training step T={T}")
                ids = random_ids(1, T, shape["vocab_size"], s.device, seed=s.seed + T)
                fam_res["train"].append({"seq_len": T, **bench_train(models, hf, ids, s, log, names)})
                free_memory(s.device)
                write_results(s, *report(), partial=True)
            for B in (batches if "decode" in parts else []):
                fam_res["decode"].append(bench_decode(models, hf, B, P, steps, s, log))
                free_memory(s.device)
                write_results(s, *report(), partial=True)
            del hf, models
            free_memory(s.device)

    def plot(plt):
        fig, ax = plt.subplots(figsize=(8, 4))
        labels, vals = [], []
        for fam, r in results.items():
            for t in r["train"]:
                for n, c in t["vs_hf"].items():
                    labels.append(f"{fam} train {t['seq_len']} {n}")
                    vals.append(c["time_ratio"])
            for d in r["decode"]:
                for n in ("ours", "ours_R2"):
                    labels.append(f"{fam} decode B={d['batch']} {n}")
                    vals.append(d["decode"]["vs_hf_static"][n]["time_ratio"])
        ax.barh(labels, vals)
        ax.axvline(1.0, color="gray", lw=1)
        ax.set(xlabel="time ours / transformers (decode: vs StaticCache)", title="ours vs transformers")
        ax.tick_params(axis="y", labelsize=7)
        return fig

    return finish(s, report, plot, log)


def markdown(results: dict, s, shape: dict, ratio: float) -> str:
    train_rows, pre_rows, dec_rows, kv_rows = [], [], [], []
    for fam, r in results.items():
        for t in r["train"]:
            cells = [fam, f"{t['seq_len']:,}", fmt_time(t["median_s"]["hf"]), fmt_bytes(t["peak_bytes"]["hf"])]
            for n in TRAIN[1:]:
                c = t["vs_hf"].get(n)
                cells.append("not run" if c is None else f"{c['time_ratio']:.2f}x / {c['peak_ratio']:.2f}x"
                             if c["peak_ratio"] else f"{c['time_ratio']:.2f}x / n/a")
            cells.append("not run" if t["R2_achieved_ratio"] is None else f"{t['R2_achieved_ratio']:.2f}")
            train_rows.append(cells)
        for d in r["decode"]:
            for stage, rows, key in (("prefill", pre_rows, "median_s"), ("decode", dec_rows, "median_s_per_step")):
                st = d[stage]
                cells = [fam, d["batch"], f"{d['prompt']:,}", fmt_time(st[key]["hf_dynamic"]),
                         fmt_time(st[key]["hf_static"])]
                for n in ("ours", "ours_R2"):
                    cells.append(f"{st['vs_hf_dynamic'][n]['time_ratio']:.2f}x / {st['vs_hf_static'][n]['time_ratio']:.2f}x")
                rows.append(cells)
            kv = d["kv"]
            kv_rows.append([fam, d["batch"], fmt_bytes(kv["hf_dynamic"]["allocated_bytes"]),
                            fmt_bytes(kv["hf_static"]["allocated_bytes"]),
                            f"{fmt_bytes(kv['ours']['allocated_bytes'])} / {fmt_bytes(kv['ours']['held_bytes'])}",
                            f"{fmt_bytes(kv['ours_R2']['allocated_bytes'])} / {fmt_bytes(kv['ours_R2']['held_bytes'])}",
                            f"{d['R2_concept_allocated_over_plain']:.3f} / {d['R2_concept_held_over_plain']:.3f}",
                            f"{d['R2_prompt_ratio']:.2f} / {d['R2_generated_ratio']:.2f}",
                            f"{d['prefill_logit_gap_vs_hf']:.1e} / {d['decode_logit_gap_vs_hf_static']:.1e}"])
    shape_txt = ", ".join(f"{k}={v}" for k, v in shape.items())
    return (f"## Ours vs transformers (same weights)\n\n{settings_line(s)}\n\n"
            f"- models: transformers' OlmoeForCausalLM / Qwen3MoeForCausalLM ({shape_txt}), random init, "
            "`experts_implementation=grouped_mm`, sdpa; ours: the same checkpoint through `vlm.hf_import`; "
            f"R{ratio:g}: converted by `vlm.convert` (strategy topk, random chunk router)\n"
            "- ratios are ours / transformers (< 1: ours faster or smaller): time = median of per-round ratios, "
            "peak = ratio of the peak-memory medians (`harness.peak_memory_interleaved`)\n\n"
            "### Training step (forward + backward, batch 1)\n\n"
            + md_table(["family", "tokens", "transformers time", "transformers peak",
                        "ours full loss: time / peak", "ours chunked loss: time / peak",
                        f"R{ratio:g} chunked: time / peak", f"R{ratio:g} achieved R"], train_rows)
            + "\n\n### Prefill (fresh caches)\n\n"
            + md_table(["family", "batch", "prompt", "transformers Dynamic", "transformers Static",
                        "ours vs Dynamic / Static", f"R{ratio:g} vs Dynamic / Static"], pre_rows)
            + "\n\n### Decode (per step)\n\n"
            + md_table(["family", "batch", "prompt", "transformers Dynamic", "transformers Static",
                        "ours vs Dynamic / Static", f"R{ratio:g} vs Dynamic / Static"], dec_rows)
            + "\n\n### KV cache after decoding (allocated / held)\n\n"
            + md_table(["family", "batch", "Dynamic", "Static", "ours", f"R{ratio:g}",
                        f"R{ratio:g} concept layers / plain same layers: allocated / held",
                        f"R{ratio:g} achieved R: prompt / generated", "max logit gap: prefill / 1st decode step"],
                       kv_rows) + "\n")


if __name__ == "__main__":
    run()
