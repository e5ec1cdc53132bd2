"""The VLM study's headline (docs/results/compare_vlm/report.json, written by ``make compare-vlm``): README's
one line, rendered by scripts/readme_figures.py (span ``figures:vlm_study_line``), never typed by hand.

Which kinds the full-token arm reads is the report's own rule (``vlm.compare.vlm_report.kinds_read``). A paired
difference counts as a win or a loss only when its mean over seeds is larger than its seed spread (the std of
the differences), and only as a comparison of merges when arm a reads some kind. A failed same-data check opens
the line with "not a fair comparison".
"""
from __future__ import annotations

from vlm.compare.vlm_report import READ_MARGIN, baseline, kinds_read

SOURCE = "`docs/results/compare_vlm/report.json`"
PAIRS = (("e-c", "avg pooling (c)"), ("e-b", "pixel shuffle (b)"), ("e-a", "all patches (a)"))


def _pts(x: float) -> str:
    return f"{100 * x:+.1f}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _verdict(d: dict) -> str:
    if d["n"] < 2 or abs(d["mean"]) <= d["std"]:
        return "within the seed spread"
    return "wins" if d["mean"] > 0 else "loses"


def _training(report: dict) -> str:
    """"600 caption steps, then 600 steps (micro-batch 16), the pretrained tower frozen" from the report's recipe."""
    how = report.get("recipe")
    if how is None:
        return report["budget"].split(",")[0]
    stages = how["stages"]
    steps = (f"{stages[0]['steps']} steps on {', '.join(d.rsplit('/', 1)[-1] for d in stages[0]['data'])}, then "
             if len(stages) > 1 else "")
    text = f"{steps}{stages[-1]['steps']} steps x micro-batch {stages[-1]['micro_batch']}"
    tower = how["tower"]
    if tower["pretrained"]:
        text += ", the pretrained scene tower" + (" frozen" if "vision" in tower["frozen"] else "")
    return text


def render_vlm_study_line(report: dict) -> str:
    arms = {a["arm"]: a for a in report["arms"]}
    acc, paired = report["accuracy"], report["paired"]
    prior, prior_question = report["prior"], report.get("prior_question") or {}
    read, rest = kinds_read(acc, prior, prior_question)
    what = "question alone" if prior_question else "answer prior"
    base = baseline(prior, prior_question)

    checks = report.get("data_checks") or []
    same = bool(checks) and all(d["same_samples"] for d in checks)
    head = (f"{len(report['seeds'])} seeds, {_training(report)} per arm"
            + (" on the same samples in the same order (checked): " if same else ": "))
    if not same:
        head = ("**not a fair comparison**: the arms' training samples differ (the report's same-data check "
                f"{'fails' if checks else 'is missing'}); " + head)
    if read:
        head += "the full-token arm (a) reads " + ", ".join(
            f"{k} {_pct(acc['a'][f'kind:{k}']['mean'])} ({what} {_pct(base[k])})" for k in read)
        if rest:
            head += f" but not {', '.join(rest)} (within {READ_MARGIN * 100:.0f} points of the {what})"
    else:
        head += (f"no arm reads the scenes (the full-token arm a is within {READ_MARGIN * 100:.0f} points of the "
                 f"{what} on every image kind: " + ", ".join(
                     f"{k} {_pct(acc['a'][f'kind:{k}']['mean'])} vs {_pct(base[k])}" for k in rest) + ")")
    parts = [head]
    pairs = [(key, label) for key, label in PAIRS if key in paired]
    if pairs:
        diffs = "; ".join(f"vs {label} {_pts(paired[key]['image']['mean'])} ± {100 * paired[key]['image']['std']:.1f} "
                          f"points on image questions"
                          + (f" ({_verdict(paired[key]['image'])})" if read else "") for key, label in pairs)
        intro = ("ConceptMoE with image R = 4 (e), at the LLM FLOPs per sample the merge arms are matched to: "
                 if read else "so the differences of ConceptMoE with image R = 4 (e) compare answer habits, not merges: ")
        parts.append(intro + diffs)
    for key in ("e-c", "e-b"):
        if key in paired and read:
            moved = [k for k in read if _verdict(paired[key][f"kind:{k}"]) != "within the seed spread"]
            if moved:
                parts.append(f"{key} per read kind: " + ", ".join(
                    f"{k} {_pts(paired[key][f'kind:{k}']['mean'])} ({_verdict(paired[key][f'kind:{k}'])})" for k in moved))
    e = arms.get("e", {})
    if e.get("ratio_image") is not None:
        parts.append(f"e's chunker reaches image R {e['ratio_image']:.2f} (target 4)")
    return "; ".join(parts) + f" ({SOURCE})"
