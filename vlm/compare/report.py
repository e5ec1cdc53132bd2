"""Report of ``vlm.compare``: the FLOPs / params match table, metrics (mean +- std over seeds),
paired arm-vs-arm differences, the training-loss PNG, ``report.md`` and ``report.json``."""
from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

from vlm.compare.config import rel
from vlm.modeling.configuration_conceptmoe_vl import ConceptMoEVLMConfig
from vlm.flops import count_params, describe, flops_per_token

FLOP_TOL, PARAM_TOL = 0.03, 0.01

# (key, header, getter, format, lower_is_better)
METRICS = [
    ("text_loss", "held-out text loss (nats/token)", lambda r: (r.get("text") or {}).get("nll_per_token"), "{:.4f}",
     True),
    ("text_bpb", "bits/byte", lambda r: (r.get("text") or {}).get("bits_per_byte"), "{:.4f}", True),
    ("vqa_acc", "VQA acc", lambda r: (r.get("vqa") or {}).get("accuracy"), "{:.3f}", False),
    ("text_ratio", "eval R (text)", lambda r: (r.get("text") or {}).get("compression_ratio"), "{:.2f}", None),
    ("vqa_ratio", "eval R (VQA prompts)", lambda r: (r.get("vqa") or {}).get("ratio"), "{:.2f}", None),
    ("vqa_ratio_image", "R image", lambda r: (r.get("vqa") or {}).get("ratio_image"), "{:.2f}", None),
    ("vqa_ratio_text", "R text", lambda r: (r.get("vqa") or {}).get("ratio_text"), "{:.2f}", None),
    ("train_lm_loss", "final train LM loss", lambda r: (r.get("last_train_record") or {}).get("lm_loss"), "{:.4f}",
     True),
    ("train_time_s", "train s", lambda r: r.get("train_time_s"), "{:.0f}", None),
]
PAIRS = [("b", "a"), ("b", "c"), ("d", "a"), ("b", "d")]


def _fmt_n(x: float) -> str:
    for div, suf in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.4g}{suf}"
    return f"{x:.4g}"


def _real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def arm_text_config(preset_path: Path):
    return ConceptMoEVLMConfig.from_yaml(preset_path).text_config


def flops_rows(cfg: dict, presets: dict, seq_len: int, by_arm: dict) -> list[dict]:
    rows = []
    for arm in cfg["arms"]:
        tc = arm_text_config(presets[arm["id"]]["vlm_path"])
        p, f = count_params(tc), flops_per_token(tc, seq_len)
        row = {"arm": arm["id"], "name": arm["name"], "label": arm["label"], "describe": describe(tc),
               "boundary_mode": tc.boundary_mode if tc.chunking else None,
               "vlm_preset": rel(presets[arm["id"]]["vlm_path"]), "lm_preset": rel(presets[arm["id"]]["lm_path"]),
               "total_params": p["total"], "activated_params": p["activated"],
               "activated_flops": f["total_no_attn_map"], "attn_map_flops": f["attn_map"], "seq_len": seq_len,
               "solver": presets[arm["id"]]["solver_info"]}
        runs = by_arm.get(arm["id"], [])
        ratios = [(r.get("text") or {}).get("compression_ratio") for r in runs]
        ratios = [x for x in ratios if _real(x)]
        if tc.chunking and ratios:
            R = statistics.mean(ratios)
            row["achieved_ratio"] = R
            row["activated_flops_achieved"] = flops_per_token(tc, seq_len, ratio=R)["total_no_attn_map"]
        elif not tc.chunking:
            row["activated_flops_achieved"] = f["total_no_attn_map"]
        measured = [r.get("params_measured") for r in runs if r.get("params_measured")]
        if measured:
            m = measured[0]
            row["lm_params_measured"] = int(m.get("lm", 0)) + int(m.get("chunker", 0))
            row["vision_projector_params"] = int(m.get("vision", 0)) + int(m.get("projector", 0))
            row["numel_check"] = row["lm_params_measured"] == p["total"]
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["params_rel"] = row["total_params"] / base["total_params"] - 1
        row["flops_rel"] = row["activated_flops"] / base["activated_flops"] - 1
        row["match_ok"] = abs(row["params_rel"]) <= PARAM_TOL and abs(row["flops_rel"]) <= FLOP_TOL
        if "activated_flops_achieved" in row and "activated_flops_achieved" in base:
            row["flops_achieved_rel"] = row["activated_flops_achieved"] / base["activated_flops_achieved"] - 1
    return rows


def flops_table(rows: list[dict]) -> str:
    n = rows[0]["seq_len"]
    lines = [("| arm | model | total params | vs a | activated params/token | activated FLOPs/token (no attn map) "
              f"| vs a | attn-map FLOPs/token @N={n} | FLOPs/token at achieved R | vs a | match (3% / 1%) |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in rows:
        ach = r.get("activated_flops_achieved")
        ach_s = (_fmt_n(ach) + (f" (R={r['achieved_ratio']:.2f})" if "achieved_ratio" in r else "")) if ach else "n/a"
        ach_rel = f"{r['flops_achieved_rel']:+.2%}" if "flops_achieved_rel" in r else "n/a"
        lines.append(f"| {r['arm']} | {r['label']} | {_fmt_n(r['total_params'])} | {r['params_rel']:+.2%} | "
                     f"{_fmt_n(r['activated_params'])} | {_fmt_n(r['activated_flops'])} | {r['flops_rel']:+.2%} | "
                     f"{_fmt_n(r['attn_map_flops'])} | {ach_s} | {ach_rel} | "
                     f"{'OK' if r['match_ok'] else '**NO - OUTSIDE TOLERANCE**'} |")
    lines.append("")
    for r in rows:
        extra = ""
        if "numel_check" in r:
            extra = (f"; model numel {r['lm_params_measured']:,} "
                     f"({'= accountant' if r['numel_check'] else '**differs from the accountant**'})")
        mode = f" [boundary_mode: {r['boundary_mode']}]" if r["boundary_mode"] else ""
        lines.append(f"- {r['arm']}: {r['describe']}{mode} -- `{r['vlm_preset']}` -> `{r['lm_preset']}`{extra}")
    vp = [r["vision_projector_params"] for r in rows if "vision_projector_params" in r]
    if vp:
        lines.append(f"- vision tower + projector (identical in every arm, not in the table): {vp[0]:,} params")
    return "\n".join(lines)


def aggregate(cfg: dict, by_arm: dict) -> dict:
    out = {}
    for arm in cfg["arms"]:
        runs = sorted(by_arm.get(arm["id"], []), key=lambda r: r["seed"])
        m = {}
        for key, _, get, _, _ in METRICS:
            vals = [get(r) for r in runs]
            real = [v for v in vals if _real(v)]
            m[key] = {"values": vals, "seeds": [r["seed"] for r in runs],
                      "mean": statistics.mean(real) if real else None,
                      "std": statistics.stdev(real) if len(real) > 1 else None}
        out[arm["id"]] = m
    return out


def _cell(stat: dict, fmt: str) -> str:
    if stat["mean"] is None:
        return "n/a"
    s = fmt.format(stat["mean"])
    if stat["std"] is not None:
        s += " ± " + fmt.format(stat["std"])
    return s


def metric_table(cfg: dict, agg: dict) -> str:
    head = "| arm | model | " + " | ".join(h for _, h, _, _, _ in METRICS) + " |"
    lines = [head, "|---|---|" + "---:|" * len(METRICS)]
    for arm in cfg["arms"]:
        m = agg[arm["id"]]
        cells = " | ".join(_cell(m[k], f) for k, _, _, f, _ in METRICS)
        lines.append(f"| {arm['id']} | {arm['label']} | {cells} |")
    return "\n".join(lines)


def per_seed_table(cfg: dict, agg: dict) -> str:
    keys = [("text_loss", "{:.4f}"), ("text_bpb", "{:.4f}"), ("vqa_acc", "{:.3f}"), ("text_ratio", "{:.2f}"),
            ("train_lm_loss", "{:.4f}")]
    lines = ["| arm | seed | text loss | bits/byte | VQA acc | eval R (text) | final train LM loss |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for arm in cfg["arms"]:
        m = agg[arm["id"]]
        for i, seed in enumerate(m["text_loss"]["seeds"]):
            vals = [m[k]["values"][i] for k, _ in keys]
            cells = [f.format(v) if _real(v) else "n/a" for v, (_, f) in zip(vals, keys, strict=True)]
            lines.append(f"| {arm['id']} | {seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired(cfg: dict, by_arm: dict) -> list[dict]:
    """Per-seed differences (same seed = same data order and init seed) for the standard pairs."""
    ids = {a["id"] for a in cfg["arms"]}
    out = []
    for x, y in PAIRS:
        if x not in ids or y not in ids:
            continue
        rx = {r["seed"]: r for r in by_arm.get(x, [])}
        ry = {r["seed"]: r for r in by_arm.get(y, [])}
        seeds = sorted(set(rx) & set(ry))
        for key, header, get, _, lower in METRICS:
            if lower is None and key != "vqa_acc":
                continue
            diffs = [get(rx[s]) - get(ry[s]) for s in seeds if _real(get(rx[s])) and _real(get(ry[s]))]
            if not diffs:
                continue
            better = sum(1 for d in diffs if (d < 0 if lower else d > 0))
            worse = sum(1 for d in diffs if (d > 0 if lower else d < 0))
            mean = statistics.mean(diffs)
            std = statistics.stdev(diffs) if len(diffs) > 1 else None
            if std is not None and std > 0:
                verdict = "better" if (mean < 0) == bool(lower) and abs(mean) > std else (
                    "worse" if abs(mean) > std else "within seed spread")
            else:
                verdict = "better" if better == len(diffs) and better else ("worse" if worse == len(diffs) and worse
                                                                          else "tie")
                verdict += " (1 seed: no spread)" if len(diffs) == 1 else ""
            out.append({"x": x, "y": y, "metric": key, "header": header, "diffs": diffs, "mean": mean, "std": std,
                        "better_in": better, "n": len(diffs), "verdict": verdict})
    return out


def paired_table(pairs: list[dict]) -> str:
    lines = ["| comparison | metric | mean diff (x - y) | std of diff | x better in | verdict |",
             "|---|---|---:|---:|---:|---|"]
    for p in pairs:
        std = f"{p['std']:.4f}" if p["std"] is not None else "n/a"
        lines.append(f"| {p['x']} vs {p['y']} | {p['header']} | {p['mean']:+.4f} | {std} | {p['better_in']}/{p['n']} | "
                     f"{p['verdict']} |")
    return "\n".join(lines)


def summary_lines(cfg: dict, pairs: list[dict]) -> list[str]:
    """One line per standard pair: held-out bits/byte and VQA accuracy (the headline metrics)."""
    labels = {a["id"]: a["label"] for a in cfg["arms"]}
    out = []
    for x, y in PAIRS:
        got = {p["metric"]: p for p in pairs if p["x"] == x and p["y"] == y}
        if "text_bpb" not in got:
            continue
        parts = []
        for key, what in (("text_bpb", "held-out bits/byte"), ("vqa_acc", "VQA acc")):
            if key in got:
                p = got[key]
                spread = f" ± {p['std']:.4f}" if p["std"] is not None else ""
                parts.append(f"{what} {p['mean']:+.4f}{spread} ({x} better in {p['better_in']}/{p['n']} seeds: "
                             f"{p['verdict']})")
        out.append(f"- **{x}** ({labels[x]}) vs **{y}** ({labels[y]}): " + "; ".join(parts))
    return out


def _curves(run_dir: Path, key: str) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    out = {}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if "loss" in rec and _real(rec.get(key)):
                out[int(rec["step"])] = float(rec[key])
    return out


def loss_png(cfg: dict, by_arm: dict, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drew = False
    for i, arm in enumerate(cfg["arms"]):
        color = colors[i % len(colors)]
        runs = sorted(by_arm.get(arm["id"], []), key=lambda r: r["seed"])
        for ax, key in ((axes[0], "lm_loss"), (axes[1], "ratio")):
            curves = [_curves(Path(r["run_dir"]), key) for r in runs]
            curves = [c for c in curves if c]
            if not curves:
                continue
            for c in curves if len(curves) > 1 else []:
                ax.plot(list(c), list(c.values()), color=color, alpha=0.25, linewidth=0.8)
            steps = sorted(set.intersection(*[set(c) for c in curves]))
            mean = [statistics.mean(c[s] for c in curves) for s in steps]
            seeds = f" (mean of {len(curves)} seeds)" if len(curves) > 1 else ""
            ax.plot(steps, mean, color=color, linewidth=1.6, label=f"{arm['id']}: {arm['label']}{seeds}")
            drew = True
    axes[0].set(xlabel="optimizer step", ylabel="training LM loss (window mean)",
                title="training loss (same data order)")
    axes[1].set(xlabel="optimizer step", ylabel="achieved R = tokens / concepts",
                title="training compression ratio")
    target = (cfg.get("match") or {}).get("ratio", 2.0)
    axes[1].axhline(target, color="grey", linestyle="--", linewidth=0.8)
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"vlm.compare: {cfg['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drew


def write_report(cfg: dict, raw: dict, presets: dict, results: list[dict], out: Path, seq_len: int,
                 seeds: list[int], wall_s: float) -> dict:
    """Write report.md / report.json / loss_curves.png under ``out``; return the report dict.

    Conventions: FLOPs are the accountant's (``vlm.flops``): forward FLOPs per token, 2 x MACs of the
    matmuls, of the LANGUAGE MODEL (the vision tower and projector are identical in every arm and are
    listed once); "activated FLOPs" exclude the attention map (the paper's matching quantity), which
    is listed separately at the training sequence length (full N x N convention). Concept layers are
    counted at the target ratio R; the achieved-R column re-counts them at the ratio the trained model
    actually reached on held-out text (boundaries are learned, so it can drift from R). Tolerances: 3%
    activated FLOPs, 1% total parameters, relative to arm a.
    """
    by_arm: dict = {}
    for r in results:
        by_arm.setdefault(r["arm"], []).append(r)
    rows = flops_rows(cfg, presets, seq_len, by_arm)
    match_ok = all(r["match_ok"] for r in rows)
    agg = aggregate(cfg, by_arm)
    pairs = paired(cfg, by_arm)
    # same data order / token budget per seed
    data_checks = []
    for seed in seeds:
        rs = [r for r in results if r["seed"] == seed]
        if rs:
            fps = {r.get("data_fingerprint") for r in rs}
            toks = {r.get("tokens_seen") for r in rs}
            data_checks.append({"seed": seed, "same_data_order": len(fps) == 1 and None not in fps,
                                "fingerprint": sorted(str(f) for f in fps), "tokens_seen": sorted(toks),
                                "same_tokens": len(toks) == 1})
    run_wall = sum(float(r.get("wall_s") or 0.0) for r in results)
    png = out / "loss_curves.png"
    have_png = bool(results) and loss_png(cfg, by_arm, png)
    t = raw.get("train") or {}
    budget = (f"{t.get('max_steps')} steps x micro-batch {t.get('micro_batch_size')} x grad-accum "
              f"{t.get('grad_accum', 1)}, rows of {seq_len} tokens (packed), same data seed per seed")
    tables = "## Matched compute (accountant, language model)\n\n" + flops_table(rows)
    if results:
        tables += ("\n\n## Held-out metrics" + (f" (mean ± std over {len(seeds)} seeds)" if len(seeds) > 1 else "")
                   + "\n\n" + metric_table(cfg, agg))
        if pairs:
            tables += ("\n\n## Verdict (paired by seed; differences x - y, bits/byte: lower is better)\n\n"
                       + "\n".join(summary_lines(cfg, pairs)))
            tables += "\n\n## Paired differences (same seed = same data order)\n\n" + paired_table(pairs)
    md = [f"# vlm.compare report: {cfg['name']}", "",
          (f"Config `{cfg['source']}`; seeds {seeds}; token budget per arm: {budget}; "
           f"{time.strftime('%Y-%m-%d %H:%M')}; this call {wall_s / 60:.1f} min wall; the {len(results)} runs "
           f"took {run_wall / 60:.1f} min of process wall time in all (reused runs included; "
           f"{cfg['jobs']} at a time)."), "",
          ("All arms within tolerance (3% activated FLOPs, 1% total params) of arm a." if match_ok else
           "**WARNING: at least one arm is OUTSIDE the matching tolerance (3% activated FLOPs / 1% params).**"), "",
          tables]
    if data_checks:
        md += ["", "## Same data, same budget", ""]
        for d in data_checks:
            md.append(f"- seed {d['seed']}: data fingerprint {'identical' if d['same_data_order'] else '**DIFFERS**'} "
                      f"across arms ({', '.join(d['fingerprint'])}); tokens seen {d['tokens_seen']}"
                      f"{'' if d['same_tokens'] else ' **DIFFER**'}")
    if results:
        md += ["", "## Per seed", "", per_seed_table(cfg, agg)]
        if have_png:
            md += ["", "## Training curves", "", f"![training loss]({png.name})"]
    md += ["", "## Notes", "",
           ("- FLOPs: forward FLOPs per token of the language model (2 x MACs of matmuls), concept layers at the "
            "target R; the attention map (full N x N) is excluded from the matched quantity and listed on its own. "
            "'At achieved R' re-counts with the ratio reached on held-out text."),
           ("- Text metrics: `eval_suites.text_eval` on "
            f"`{cfg['eval']['text']}` (first {cfg['eval']['text_max_tokens']} tokens, non-overlapping windows). "
            "VQA: held-out digits split, greedy, exact match; eval R on the VQA prompts is tokens / concepts "
            "(image / text tokens separately)."),
           "- Arm c uses arm b's architecture with a boundary every round(R) tokens (`boundary_mode: fixed`).",
           ("- Verdicts: differences are paired by seed (same data order and init seed); 'better' / 'worse' when "
            "the mean difference exceeds one standard deviation of the per-seed differences, else 'within seed "
            "spread'; with one seed there is no spread and the verdict is only the sign.")]
    (out / "report.md").write_text("\n".join(md) + "\n")
    report = {"name": cfg["name"], "config": cfg["source"], "seeds": seeds, "seq_len": seq_len,
              "tolerances": {"activated_flops": FLOP_TOL, "params": PARAM_TOL}, "match_ok": match_ok,
              "budget": budget, "wall_s": wall_s, "runs_wall_s": run_wall, "arms": rows, "metrics": agg,
              "paired": pairs, "data_checks": data_checks, "loss_png": png.name if have_png else None,
              "runs": results}
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    return {"match_ok": match_ok, "markdown_tables": tables, "report": report}
