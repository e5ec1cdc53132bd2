"""Report of the VLM study (``study: vlm``): the arms' match table (LLM params, FLOPs per sample for
training and inference, image tokens per image, target and achieved R), held-out accuracy per question
kind (mean +- std over seeds, the answer priors beside it), paired differences vs arms a and b, the
split by clutter and glyph size with the wins and losses of learned merging, prefill time per sample
measured side by side, whether each arm reads the image at all (image-token spread, answer shift when
the image is swapped), accuracy vs inference FLOPs (PNG) and pictures of the chunker's concepts."""
from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from pathlib import Path

from vlm.compare import vlm_match
from vlm.compare.config import rel, repo_path
from vlm.compare.data_fit import same_data_section
from vlm.modeling.config_base import deep_merge

KINDS = ("identity", "position", "counting", "comparison", "reading", "text")
SPLITS = {"clutter": ("clean", "low", "high"), "glyph_size": ("small", "large")}


def _groups(raw: dict) -> tuple[Counter, dict, dict]:
    """Question counts per group (kind|clutter|glyph_size) of the scored records, the answer prior per kind
    (accuracy of always answering the kind's most frequent answer) and the question-only prior per kind:
    the accuracy of answering each question text with its most frequent answer in the training split beside
    the eval file (``<x>_test.json`` -> ``<x>_train.json``; the kind's most frequent training answer for a
    text it never saw): what the question alone gives, e.g. 50% on "Which digit is larger, the top-left or
    the top-right?" by naming either. None per kind without that training split."""
    e = raw["eval"]
    path = repo_path(e["vqa_json"])
    records = json.loads(path.read_text())[: e.get("limit") or None]
    counts = Counter(r["group"] for r in records)
    train_path = path.with_name(path.name.replace("_test.json", "_train.json"))
    train = json.loads(train_path.read_text()) if train_path != path and train_path.is_file() else None
    prior, prior_question = {}, {}
    for k in KINDS:
        answers = Counter(r["conversations"][1]["value"] for r in records if r["kind"] == k)
        prior[k] = max(answers.values()) / sum(answers.values()) if answers else None
        prior_question[k] = None if train is None or not answers else _question_only(
            [r for r in train if r["kind"] == k], [r for r in records if r["kind"] == k])
    return counts, prior, prior_question


READ_MARGIN = 0.10  # an arm reads a kind when it is this far above the question-only prior


def baseline(prior: dict, prior_question: dict) -> dict:
    """Per image kind (``KINDS`` but text): what the question alone gives, the question-only prior, or the
    kind's answer prior where that is None (a report written without a training split)."""
    return {k: prior_question.get(k) if prior_question.get(k) is not None else prior[k] for k in KINDS[:-1]}


def kinds_read(accuracy: dict, prior: dict, prior_question: dict, arm: str = "a") -> tuple[list[str], list[str]]:
    """Image kinds where ``arm``'s mean accuracy is ``READ_MARGIN`` above ``baseline``, and the rest."""
    base = baseline(prior, prior_question)
    read = [k for k in KINDS[:-1] if base[k] is not None and arm in accuracy
            and (accuracy[arm][f"kind:{k}"]["mean"] or 0) - base[k] >= READ_MARGIN]
    return read, [k for k in KINDS[:-1] if k not in read]


def _question_only(train: list[dict], scored: list[dict]) -> float:
    by_text: dict[str, Counter] = {}
    for r in train:
        by_text.setdefault(r["conversations"][0]["value"], Counter())[r["conversations"][1]["value"]] += 1
    overall = Counter(r["conversations"][1]["value"] for r in train)
    fallback = overall.most_common(1)[0][0] if overall else None
    guess = {q: c.most_common(1)[0][0] for q, c in by_text.items()}
    return sum(guess.get(r["conversations"][0]["value"], fallback) == r["conversations"][1]["value"]
               for r in scored) / len(scored)


def _select(key: str):
    """Group filter of a metric key: "kind:x", "clutter:y", "glyph_size:z", "kind:x|clutter:y", "image"."""
    parts = [] if key == "image" else [p.split(":") for p in key.split("|")]
    index = {"kind": 0, "clutter": 1, "glyph_size": 2}

    def ok(group: str) -> bool:
        fields = group.split("|")
        if fields[0] == "text" and not any(f == "kind" for f, _ in parts):
            return False  # "image" and the clutter / size splits count image questions only
        return all(fields[index[f]] == v for f, v in parts)
    return ok


def metric_keys() -> list[str]:
    keys = ["image"] + [f"kind:{k}" for k in KINDS]
    keys += [f"{f}:{v}" for f, vals in SPLITS.items() for v in vals]
    keys += [f"kind:{k}|{f}:{v}" for k in KINDS[:-1] for f, vals in SPLITS.items() for v in vals]
    return keys


def run_metrics(result: dict, counts: Counter) -> dict:
    by_group = (result.get("vqa") or {}).get("by_kind") or {}
    out = {}
    for key in metric_keys():
        sel = [(g, n) for g, n in counts.items() if _select(key)(g) and g in by_group]
        total = sum(n for _, n in sel)
        out[key] = sum(by_group[g] * n for g, n in sel) / total if total else None
        out[key + "#n"] = total
    return out


def _stat(values: list) -> dict | None:
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    return {"mean": statistics.mean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else None, "n": len(xs)}



def recipe(cfg: dict, raw: dict) -> dict:
    """How every arm trains: the stages (steps, micro-batch, data files), the tower's weights (and the
    held-out patch accuracy its pretraining wrote beside them) and the frozen parts."""
    t = raw.get("train") or {}
    stages = []
    for over in ([cfg["first_stage"]] if cfg.get("first_stage") else []) + [{}]:
        st = deep_merge(t, over.get("train") or {})
        data = deep_merge(raw.get("data") or {}, over.get("data") or {})
        stages.append({"steps": st.get("max_steps"), "micro_batch": st.get("micro_batch_size"),
                       "data": [d.get("path") for d in data.get("datasets", [])]})
    weights = (cfg.get("vlm") or {}).get("vision", {}).get("pretrained")
    tower = {"pretrained": weights, "frozen": sorted(k for k, v in (t.get("freeze") or {}).items() if v)}
    summary = repo_path(weights).with_suffix(".json") if weights else None
    if summary is not None and summary.is_file():
        pre = json.loads(summary.read_text())
        tower["pretraining"] = {"steps": pre.get("steps"), "held_out_accuracy": pre.get("held_out_accuracy")}
    return {"stages": stages, "tower": tower}


def tower_line(tower: dict) -> str:
    frozen = f"frozen: {', '.join(tower['frozen'])}" if tower["frozen"] else "nothing frozen"
    if not tower["pretrained"]:
        return f"Vision tower: random init (`vision.pretrained: null`); {frozen}."
    pre = tower.get("pretraining")
    acc = ("; its pretraining: " + ", ".join(f"{k} {v:.1%}" for k, v in pre["held_out_accuracy"].items())
           + f" of held-out patches right after {pre['steps']} steps") if pre else ""
    return f"Vision tower: `{tower['pretrained']}` (`make scene-tower`){acc}; {frozen}."

def _cell(s: dict | None, pct: bool = True) -> str:
    if s is None:
        return "n/a"
    f = (lambda x: f"{100 * x:.1f}") if pct else (lambda x: f"{x:.3g}")
    return f(s["mean"]) + ("" if s["std"] is None else f" ± {f(s['std'])}")


def paired(metrics: dict, x: str, y: str, key: str) -> dict | None:
    """x - y per seed (same data order and init seed), mean +- std."""
    common = sorted(set(metrics.get(x, {})) & set(metrics.get(y, {})))
    diffs = [metrics[x][s][key] - metrics[y][s][key] for s in common
             if metrics[x][s].get(key) is not None and metrics[y][s].get(key) is not None]
    return _stat(diffs)


def verdict(d: dict | None) -> str:
    if d is None:
        return "n/a"
    if d["std"] is None:
        return "higher (1 seed, sign only)" if d["mean"] > 0 else "lower (1 seed, sign only)" if d["mean"] < 0 else "equal"
    if abs(d["mean"]) <= d["std"]:
        return "within seed spread"
    return "wins" if d["mean"] > 0 else "loses"


def _fmt_n(x) -> str:
    for div, suf in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.4g}{suf}"
    return f"{x:.4g}"


def match_table(rows: list[dict]) -> str:
    head = ("| arm | projector merge | image tokens / image | LLM params | top-k / concept top-k | target R | "
            "FLOPs/sample train | FLOPs/sample inference | vs match_to | achieved R image / text | "
            "inference FLOPs at achieved R |\n|---|---|---:|---:|---|---|---:|---:|---:|---|---:|")
    lines = [head]
    for r in rows:
        rel_ = "anchor" if r["arm"] == "e" else "reference" if r["arm"] == "a" else "n/a"
        if "flops_rel" in r:
            rel_ = f"{r['flops_rel']:+.2%} vs {r['match_to']}" + ("" if r["match_ok"] else
                                                                  " **LIMIT**" if r.get("at_limit") else " **NO**")
        ach = ("n/a" if r["ratio_image"] is None else f"{r['ratio_image']:.2f} / {r['ratio_text']:.2f}")
        lines.append(f"| {r['arm']} {r['label']} | {r['merge']} | {r['image_tokens']} | {_fmt_n(r['lm_params'])} | "
                     f"{r['top_k']} / {r['concept_top_k'] or '-'} | {r['target_R']} | {_fmt_n(r['flops_train'])} | "
                     f"{_fmt_n(r['flops_fwd'])} | {rel_} | {ach} | {_fmt_n(r['flops_fwd_achieved'])} |")
    return "\n".join(lines)


USE_KEYS = ("patch_spread", "image_spread", "tv", "flip_rate", "max_logit_change")


def image_use_table(arm_ids: list[str], image_use: dict, agg: dict) -> list[str]:
    """Markdown lines: per arm, the spread of its image tokens and how far its answer moves when the image
    is swapped (vlm.compare.image_use), mean +- std over the seeds whose export was measured."""
    n = next((r["records"] for by_seed in image_use.values() for r in by_seed.values() if "records" in r), "n/a")
    lines = [("Each trained export on the same first "
              f"{n} held-out image records. Token spread: mean |x_i - x_j| of the image tokens the language model "
              "receives (vision tower + projector), over token pairs of one image (across patches) or over image "
              "pairs at one token slot (across images), divided by their mean |x|; ~0 means the projector hands "
              "the model one constant vector. Answer shift: the answer's next-token distribution with the record's "
              "own image vs another record's image (same question): total-variation distance, share of records "
              "whose greedy first answer token changes, mean of the largest logit change. **An answer shift of ~0 "
              "means the arm answers from the question alone**, so its accuracy cannot rise above what the question "
              "alone gives (the answer priors), whatever its merge."),
             "", "| arm | seeds | token spread across patches | token spread across images | answer TV own vs "
             "other image | first answer token changes (%) | max logit change |", "|---|---:|---:|---:|---:|---:|---:|"]
    for a in arm_ids:
        if a not in agg:
            continue
        s = agg[a]
        missing = [seed for seed, r in image_use[a].items() if "missing" in r]
        seeds = str(len(image_use[a]) - len(missing)) + (f" ({len(missing)} export(s) gone)" if missing else "")
        lines.append(f"| {a} | {seeds} | {_cell(s['patch_spread'], False)} | {_cell(s['image_spread'], False)} | "
                     f"{_cell(s['tv'], False)} | {_cell(s['flip_rate'])} | {_cell(s['max_logit_change'], False)} |")
    return lines


def accuracy_png(rows: list[dict], agg: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=110)
    for r in rows:
        s = agg.get(r["arm"], {}).get("image")
        if s is None:
            continue
        ax.errorbar(r["flops_fwd_achieved"], 100 * s["mean"], yerr=100 * (s["std"] or 0), fmt="o", capsize=3)
        ax.annotate(f"{r['arm']}: {r['label']}", (r["flops_fwd_achieved"], 100 * s["mean"]), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel("LLM inference FLOPs per sample (at the achieved R)")
    ax.set_ylabel("held-out accuracy, image questions (%)")
    ax.set_title("accuracy vs inference FLOPs (mean ± std over seeds)", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def write_vlm_report(cfg: dict, raw: dict, presets: dict, results: list[dict], out: Path, seq_len: int,
                     seeds: list[int], wall_s: float, probe_results: dict | None = None,
                     image_use: dict | None = None, data_fit: list[dict] | None = None) -> dict:
    """Write report.md / report.json (+ accuracy_vs_flops.png, pictures/) under ``out``; ``data_fit``: the rows
    of ``vlm.compare.data_fit.check_study`` (no training sample cut)."""
    by_arm: dict = {}
    for r in results:
        by_arm.setdefault(r["arm"], []).append(r)
    grid = vlm_match.patch_grid(cfg["vlm"]["vision"])
    measured = {}
    for a, runs in by_arm.items():
        ri = [(r.get("vqa") or {}).get("ratio_image") for r in runs]
        rt = [(r.get("vqa") or {}).get("ratio_text") for r in runs]
        ri, rt = [x for x in ri if x], [x for x in rt if x]
        if ri and rt:
            measured[a] = {"ratio_image": statistics.mean(ri), "ratio_text": statistics.mean(rt)}
    rows = vlm_match.match_rows(cfg, {a: p["lm_cfg"] for a, p in presets.items()}, grid, seq_len, measured)
    for row in rows:  # under-spends with every expert active: no knob left to reach the target
        lm = presets[row["arm"]]["lm_cfg"]
        maxed = lm.top_k == lm.num_experts and (not lm.chunking or lm.concept_top_k == lm.num_experts)
        row["at_limit"] = maxed and not row.get("match_ok", True) and row["flops_rel"] < 0
    match_ok = all(r.get("match_ok", True) or r["at_limit"] for r in rows)
    counts, prior, prior_question = _groups(raw)
    metrics = {a: {r["seed"]: run_metrics(r, counts) for r in runs} for a, runs in by_arm.items()}
    keys = metric_keys()
    agg = {a: {k: _stat([m[s].get(k) for s in m]) for k in keys} for a, m in metrics.items()}
    arm_ids = [r["arm"] for r in rows]
    t = raw.get("train") or {}
    budget = (f"{t.get('max_steps')} steps x micro-batch {t.get('micro_batch_size')} samples, rows of {seq_len} "
              "tokens (packed), same data seed per seed")
    how = recipe(cfg, raw)
    if len(how["stages"]) > 1:
        first = how["stages"][0]
        budget += (f", after a first stage of {first['steps']} steps x micro-batch {first['micro_batch']} "
                   f"on {', '.join(f'`{d}`' for d in first['data'])} (the second starts from its export)")
    md = [f"# vlm.compare VLM study: {cfg['name']}", "",
          (f"Config `{cfg['source']}`; seeds {seeds}; budget per arm: {budget}; {time.strftime('%Y-%m-%d %H:%M')}; "
           f"this call {wall_s / 60:.1f} min wall, its {len(results)} runs {sum(r.get('wall_s') or 0 for r in results) / 60:.0f} "
           f"min summed ({cfg['jobs']} at once). Data: `{raw['eval']['vqa_json']}` (first "
           f"{raw['eval'].get('limit')} records scored; greedy, exact match)."), "", tower_line(how["tower"]), ""]
    md += ["## Matched compute (accountant: `vlm.flops.llm_flops_per_sample`)", "",
           (f"LLM forward FLOPs per sample (2 x MACs of the matmuls, attention map excluded) of "
            f"{cfg['match']['text_tokens']} text tokens (`match.text_tokens`, the mean prompt + answer of the "
            "scenes) + the arm's image tokens, concept layers at the target R; training = 3 x forward. "
            f"Arms with `match_to` are solved (top-k / concept top-k) to within {vlm_match.SAMPLE_TOL:.0%} of that "
            "arm. The vision tower is the same in every arm and not counted."), "", match_table(rows), ""]
    if not match_ok:
        md += ["**WARNING: an arm is outside the FLOPs-per-sample tolerance.**", ""]
    for r in rows:
        if r["at_limit"]:
            md.append(f"- arm {r['arm']} cannot reach arm {r['match_to']}'s FLOPs per sample: it spends "
                      f"{-r['flops_rel']:.1%} less even with every expert active (top-k = E); compared as is.")
    read = kinds_read(agg, prior, prior_question)[0] if results else []
    if results:
        md += ["", f"## Held-out accuracy per question kind (% , mean ± std over {len(seeds)} seed(s))", "",
               "| arm | image questions | " + " | ".join(KINDS) + " |", "|---|---:|" + "---:|" * len(KINDS)]
        for label, p in (("answer prior", prior), ("question-only prior", prior_question)):
            md.append(f"| {label} | - | " + " | ".join("n/a" if p[k] is None else f"{100 * p[k]:.1f}"
                                                       for k in KINDS) + " |")
        for a in arm_ids:
            if a in agg:
                md.append(f"| {a} | {_cell(agg[a]['image'])} | " + " | ".join(_cell(agg[a][f'kind:{k}'])
                                                                          for k in KINDS) + " |")
        if "a" in agg and not read:
            md += ["", (f"**No arm reads the scenes at this budget**: the full-token arm (a) is within "
                        f"{READ_MARGIN * 100:.0f} points of the question-only prior on every image kind, so the "
                        "differences below compare how the arms answer from the question alone, not their merges.")]
        md += ["", "## Paired differences (x - y, same seed = same data order; points of accuracy)", "",
               "| pair | image questions | " + " | ".join(KINDS) + " |", "|---|---:|" + "---:|" * len(KINDS)]
        pairs = {}
        for ref in ("a", "b"):
            for x in arm_ids:
                if x in (ref, "a") or x not in metrics or ref not in metrics:
                    continue
                pairs[f"{x}-{ref}"] = {k: paired(metrics, x, ref, k) for k in keys}
                md.append(f"| {x} - {ref} | {_cell(pairs[f'{x}-{ref}']['image'])} | "
                          + " | ".join(_cell(pairs[f'{x}-{ref}'][f'kind:{k}']) for k in KINDS) + " |")
        if "e" in metrics and "c" in metrics:  # learned merging vs the pooling anchor (item 4)
            pairs["e-c"] = {k: paired(metrics, "e", "c", k) for k in keys}
            md.append(f"| e - c | {_cell(pairs['e-c']['image'])} | "
                      + " | ".join(_cell(pairs['e-c'][f'kind:{k}']) for k in KINDS) + " |")
        md += ["", "## Where learned merging wins or loses (item 4): clutter and glyph size", ""]
        for f, vals in SPLITS.items():
            md += ["| arm | " + " | ".join(f"{f}={v}" for v in vals) + " |", "|---|" + "---:|" * len(vals)]
            for a in arm_ids:
                if a in agg:
                    md.append(f"| {a} | " + " | ".join(_cell(agg[a][f'{f}:{v}']) for v in vals) + " |")
            md.append("")
        for x, y in (("e", "c"), ("e", "b"), ("f", "b")):
            key = f"{x}-{y}"
            if key not in pairs:
                continue
            md.append(f"- **{x} vs {y}** (x - y, points):")
            for k in KINDS[:-1]:
                parts = []
                for f, vals in SPLITS.items():
                    for v in vals:
                        d = pairs[key].get(f"kind:{k}|{f}:{v}")
                        if d is not None:
                            parts.append(f"{v} {_cell(d)} ({verdict(d)})")
                if parts:
                    md.append(f"  - {k}: " + "; ".join(parts))
        pairs_out = pairs
    else:
        pairs_out = {}
    data_checks, lines = same_data_section(results, seeds, data_fit)
    md += lines
    probe_results = probe_results or {}
    if probe_results:
        md += ["", "## Prefill time and what the chunker merged", "",
               ("Prefill: one forward over the same held-out prompts per arm (batch of "
                f"{next(iter(probe_results.values()))['prefill_samples']}), arms interleaved rep by rep, median of "
                f"{next(iter(probe_results.values()))['prefill_reps']} reps, divided by the batch; seed "
                f"{seeds[0]}'s exports, {cfg['threads'] or 'default'} torch thread(s). Boundary rate: the share of "
                "image tokens that start a new concept, on grid cells with a glyph pixel vs background cells."), "",
               "| arm | prefill ms / sample | boundary rate glyph cells | boundary rate background cells |",
               "|---|---:|---:|---:|"]
        for a in arm_ids:
            p = probe_results.get(a)
            if p:
                g, b = p.get("boundary_rate_glyph"), p.get("boundary_rate_background")
                md.append(f"| {a} | {p['prefill_ms_per_sample']:.2f} | {'-' if g is None else f'{g:.2f}'} | "
                          f"{'-' if b is None else f'{b:.2f}'} |")
        pics = [(a, pic) for a in arm_ids for pic in (probe_results.get(a) or {}).get("pictures", [])]
        if pics:
            md += ["", "Concepts on held-out scenes (patches coloured by concept, a black box where one starts):", ""]
            md += [f"![arm {a}, clutter {p['clutter']}, {p['glyph_size']} glyphs](pictures/{p['file']})" for a, p in pics]
    image_use = image_use or {}
    use_agg = {a: {k: _stat([r.get(k) for r in by_seed.values()]) for k in USE_KEYS} for a, by_seed in image_use.items()}
    if image_use:
        md += ["", "## Does each arm read the image?", "", *image_use_table(arm_ids, image_use, use_agg)]
    png = out / "accuracy_vs_flops.png"
    have_png = bool(results) and accuracy_png(rows, agg, png)
    if results:
        md += ["", "## Accuracy vs inference FLOPs", "",
               f"![accuracy vs FLOPs]({png.name})" if have_png else "(matplotlib is not installed: no plot)"]
    (out / "report.md").write_text("\n".join(md) + "\n")
    report = {"name": cfg["name"], "study": "vlm", "config": cfg["source"], "seeds": seeds, "match_ok": match_ok,
              "arms": rows, "accuracy": agg, "prior": prior,
              "prior_question": prior_question,
              "kinds_read": read, "paired": pairs_out, "probe": probe_results,
              "image_use": image_use, "image_use_stats": use_agg, "data_checks": data_checks,
              "data_fit": data_fit,
              "budget": budget, "recipe": how, "wall_s": wall_s, "runs": results, "plot": png.name if have_png else None}
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    tables = "\n".join(md[md.index("## Matched compute (accountant: `vlm.flops.llm_flops_per_sample`)"):][:len(rows) + 6])
    return {"match_ok": match_ok, "markdown_tables": tables, "report": report, "rel": rel(out / "report.md")}
