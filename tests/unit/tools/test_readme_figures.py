"""The figures of README.md and docs/*.md are the committed run files' (docs/results/train-vlm/, written by
make train-vlm and make eval, copied by scripts/readme_figures.py --publish; benchmarks/results/, written by
make bench), not hand edits: any drift fails here."""
from __future__ import annotations

import copy
import importlib.util
import json
import shutil

import pytest

from vlm.config.train import REPO_ROOT

spec = importlib.util.spec_from_file_location("readme_figures", REPO_ROOT / "scripts" / "readme_figures.py")
figures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(figures)


def _load(name: str) -> dict:
    return json.loads((figures.RESULTS / name).read_text())


def test_readme_figures_are_the_committed_runs():
    spans = figures.page_spans()
    expected = figures.all_figures()
    assert set(spans) == {"train", "eval", "bench", "vs_transformers", "overhead", "inference", "tests", "serving",
                          "serving_line", "vlm_study_line"}
    assert "train" in figures.readme_spans(figures.README.read_text(encoding="utf-8"))  # the demo's result: README
    for key, text in expected.items():
        assert spans[key] == text, f"figures:{key} differ from docs/results/train-vlm/, benchmarks/results/ " \
                                   f"(python scripts/readme_figures.py --publish ... / --bench):\n  page: {spans[key]}\n  files:  {text}"
    assert figures.main(["--check"]) == 0


def test_every_figure_comes_from_the_files():
    """Each number of the sentences moves with its field of summary.json / results.json."""
    summary, run, results = _load("summary.json"), _load("run.json"), _load("results.json")
    base = figures.render_train(summary, run)
    assert f"**{summary['eval']['accuracy']:.1%} held-out accuracy**" in base
    for path, value, shown in [(("eval", "accuracy"), 0.5, "**50.0% held-out"),
                               (("eval", "correct"), 150, "(150/"),
                               (("eval", "ratio"), 9.87, "ratio 9.87 pooled"),
                               (("eval", "ratio_text"), 7.65, "text 7.65"),
                               (("wall_time_s",), 61.4, "1 min 1 s wall"),
                               (("train_time_s",), summary["tokens_seen"] / 1234.0, "1,234 tokens/s")]:
        changed = copy.deepcopy(summary)
        target = changed
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        text = figures.render_train(changed, run)
        assert text != base and shown in text, (path, text)
    changed = copy.deepcopy(results)
    changed["results"]["cmoe_digits_mc"]["acc,none"] = 0.123
    assert "acc **0.123**" in figures.render_eval(changed)


def test_vs_transformers_cells_and_verdicts_come_from_the_files():
    """The target table of docs/performance.md: each cell moves with its ratio in vs_transformers.json, and
    the verdict follows the exact ratio against the target (a cell that rounds to the target can miss)."""
    run = json.loads((figures.BENCH / "vs_transformers.json").read_text())
    fams = list(run["results"])
    for fam in fams:
        run["results"][fam]["train"][0]["vs_hf"]["ours_full"]["time_ratio"] = 0.8
    text = figures.render_vs_transformers([run])
    assert "| 0.800x | 0.800x | met |" in text
    run["results"][fams[0]]["train"][0]["vs_hf"]["ours_full"]["time_ratio"] = 0.9004
    text = figures.render_vs_transformers([run])
    assert "| 0.900x | 0.800x | met for " + fams[1] + ", missed for " + fams[0] + " |" in text
    eight = copy.deepcopy(run)
    for fam in fams:
        eight["results"][fam]["train"][0]["seq_len"] = 8192
        eight["results"][fam]["decode"] = []
    eight["settings"]["sizes"] = [8192]
    both = figures.render_vs_transformers([run, eight])
    assert ", 8K tokens (<= 0.90x)" in both and both.count("StaticCache") == 1 and "vs_transformers_8K.json" in both


def test_publish_copies_the_run_files_and_rewrites_the_spans(tmp_path):
    run, ev, out = tmp_path / "run", tmp_path / "eval", tmp_path / "out"
    (run / "hf").mkdir(parents=True)
    ev.mkdir()
    shutil.copyfile(figures.RESULTS / "summary.json", run / "summary.json")
    shutil.copyfile(figures.RESULTS / "results.json", ev / "results.json")
    (run / "hf" / "config.json").write_text(json.dumps({"text_config": {"target_ratio": 3.0}}))
    figures.publish(run, ev, out=out)
    assert (out / "summary.json").read_bytes() == (run / "summary.json").read_bytes()
    assert (out / "results.json").read_bytes() == (ev / "results.json").read_bytes()
    meta = json.loads((out / "run.json").read_text())
    assert meta["target_ratio"] == 3.0 and len(meta["commit"]) == 40
    text = "a <!-- figures:train -->old<!-- /figures --> b <!-- figures:eval -->old<!-- /figures -->."
    new = figures.rewrite(text, figures.rendered(out))
    assert figures.readme_spans(new) == figures.rendered(out) and "target 3;" not in new and "target 3)" in new
    with pytest.raises(ValueError, match="no <!-- figures:eval"):
        figures.rewrite("<!-- figures:train -->x<!-- /figures -->", figures.rendered(out))


def test_every_bench_figure_comes_from_the_files():
    """Each cell of the result table moves with its field of prefill.json / decode.json."""
    prefill, decode = (json.loads((figures.BENCH / f"{name}.json").read_text()) for name in ("prefill", "decode"))
    base = figures.render_bench(prefill, decode)
    for doc, where, key, value, shown in [
            (prefill, ("results", 3, "speedup"), "median_of_ratios", 0.987, "+98.7% ["),
            (prefill, ("results", 3, "speedup"), "ratio_q3", 1.5, ", +150.0]"),
            (prefill, ("results", 0), "predicted_speedup_causal", 0.456, "| +45.6% |"),
            (decode, ("results", 9, "speedup"), "median_of_ratios", -0.321, "-32.1% ["),
            (decode, ("machine",), "git", "abc1234", f"commit {prefill['machine']['git']} / abc1234")]:
        changed = copy.deepcopy(doc)
        target = changed
        for step in where:
            target = target[step]
        target[key] = value
        text = figures.render_bench(changed, decode) if doc is prefill else figures.render_bench(prefill, changed)
        assert text != base and shown in text, (where, key, text)


def test_a_span_marked_on_two_pages_is_refused(tmp_path, monkeypatch):
    for name in ("a.md", "b.md"):
        (tmp_path / name).write_text("<!-- figures:train -->x<!-- /figures -->\n")
    monkeypatch.setattr(figures, "pages", lambda: [tmp_path / "a.md", tmp_path / "b.md"])
    monkeypatch.setattr(figures, "ROOT", tmp_path)
    with pytest.raises(ValueError, match="figures:train marked in a.md and b.md"):
        figures.page_spans()


def test_overhead_and_test_time_figures_move_with_their_files():
    """docs/performance.md's overhead table and README's unit-tier time are rendered from their files."""
    import json

    run = json.loads((figures.BENCH / "overhead.json").read_text())
    run["results"]["conceptmoe"]["ops"] = 12_345
    assert "| ConceptMoE | 12,345 |" in figures.render_overhead(run)
    unit = json.loads((figures.TESTS / "unit.json").read_text())
    text = figures.render_tests({**unit, "wall_s": 61.0, "load_before": 7.25})
    assert "in 1 min 01 s" in text and "load average 7.2" in text and unit["commit"] in text


def test_inference_figures_move_with_their_file():
    """docs/performance.md's which-to-pick table: each time, ratio and count moves with inference.json, a
    mode that did not run says so, and each verdict is the one the run computed."""
    import json

    run = json.loads((figures.BENCH / "inference.json").read_text())
    dec = run["results"]["decode"][0]
    dec["ms_per_step"]["ours"] = 12.5
    dec["vs_reference"]["ours"]["median"] = 0.4321
    first_batch = next(iter(run["results"]["counts"]))
    run["results"]["counts"][first_batch]["ours"]["ops_per_step"] = 4321
    text = figures.render_inference(run)
    row = next(line for line in text.splitlines() if line.startswith("| ours, plain MoE |"))
    assert "12.5 ms (0.43x)" in row and "4,321" in row
    del dec["ms_per_step"]["ours"]
    dec["failed"]["ours"] = "RuntimeError: cannot"
    text = figures.render_inference(run)
    assert "did not run" in text and "Did not run: ours, plain MoE (decode): RuntimeError: cannot." in text
    for met, word in ((True, "| met |"), (False, "| missed |"), (None, "| not measured on this device |")):
        run["targets"] = [dict(run["targets"][0], met=met)]
        assert word in figures.render_inference(run)


def test_serving_figures_move_with_their_file():
    """docs/serving.md's table and README's serving line: tokens/s, the c=32 engine / sequential ratio and its
    spread, latencies, admission ratios and verdicts, the engine-measured rows and the commit each move with
    serving.json; a run without concurrency 32 is refused (its target is judged there)."""
    run = json.loads((figures.BENCH / "serving.json").read_text())
    c32 = next(r for r in run["results"] if r["concurrency"] == 32)
    c32["engine"]["tokens_per_s_rounds"].update(median=12345.6, q1=12000.0, q3=13000.4)
    c32["engine_over_sequential_rounds"].update(median=3.456, q1=3.1, q3=3.9)
    c32["engine"]["itl_p99"] = 0.0425
    run["machine"]["git"] = "abc1234"
    lay = run["admission"]["layouts"]
    lay[0].update(admitted_ratio=1.9, meets_target=True, concept_admitted=61)
    for r in lay[1:]:
        r["meets_target"] = False
    run["admission"]["engine"]["concept"]["peak_rows"] = 99
    run["admission"]["engine"].update(matches_plan=False, peak_ratio=2.345)
    next(t for t in run["targets"] if t["what"].startswith("tokens/s"))["met"] = False
    doc, line = figures.render_serving(run), figures.render_serving_line(run)
    row = next(r for r in doc.splitlines() if r.startswith("| 32 |"))
    assert row.startswith("| 32 | 12,346 [12,000-13,000] |") and "| 3.46x [3.10-3.90] |" in row and "/ 42.5 ms |" in row
    assert "**3.46x [3.10-3.90]**" in doc and "target >= 4x: missed" in doc
    assert f"| {lay[0]['layout']}, {lay[0]['split']} |" in doc and "| 32 / 61 | 1.90x |" in doc
    assert "| ConceptMoE |" in doc and "| 99 |" in doc and "NOT the planned counts" in doc and "commit abc1234" in doc
    assert "**3.46x [3.10-3.90]**" in line and "(target 4x: missed)" in line and "admits 2.35x" in line
    assert f"{lay[0]['layout']} ({lay[0]['split']}) 1.90x" in line and f"; {lay[0]['layout']} reaches 1.8x," in line
    assert "commit abc1234" in line and line.count("\n") == 0
    for r in lay:
        r["meets_target"] = False
    assert "; none reaches 1.8x," in figures.render_serving_line(run)
    run["results"] = [r for r in run["results"] if r["concurrency"] != 32]
    with pytest.raises(ValueError, match="no concurrency-32 row"):
        figures.render_serving_line(run)


def test_vlm_study_line_moves_with_its_report():
    """README's VLM study line: the kinds arm a reads (10 points above the question-only prior), the paired
    differences with their seed spread and verdicts (none when arm a reads nothing), and e's achieved image R
    all come from report.json."""
    from scripts.figures_vlm_study import render_vlm_study_line

    report = json.loads((figures.STUDIES / "report.json").read_text())
    report["prior_question"] = {k: 0.2 for k in ("identity", "position", "counting", "comparison", "reading", "text")}
    report["accuracy"]["a"]["kind:counting"]["mean"] = 0.55
    for k in ("identity", "position", "comparison", "reading"):
        report["accuracy"]["a"][f"kind:{k}"]["mean"] = 0.25
    report["paired"]["e-c"]["image"].update(mean=0.0421, std=0.011, n=3)
    report["paired"]["e-c"]["kind:counting"].update(mean=-0.05, std=0.01, n=3)
    report["paired"]["e-b"]["image"].update(mean=0.01, std=0.02, n=3)
    next(a for a in report["arms"] if a["arm"] == "e")["ratio_image"] = 3.87
    report["data_checks"] = [{"seed": s, "same_samples": True} for s in report["seeds"]]
    line = render_vlm_study_line(report)
    assert "the full-token arm (a) reads counting 55.0% (question alone 20.0%)" in line
    assert "but not identity, position, comparison, reading (within 10 points of the question alone)" in line
    assert "vs avg pooling (c) +4.2 ± 1.1 points on image questions (wins)" in line
    assert "vs pixel shuffle (b) +1.0 ± 2.0 points on image questions (within the seed spread)" in line
    assert "e-c per read kind: counting -5.0 (loses)" in line and "image R 3.87 (target 4)" in line
    assert line.count("\n") == 0 and render_vlm_study_line(report) == line
    report["accuracy"]["a"]["kind:counting"]["mean"] = 0.25  # now no kind is read: no verdicts, said so
    line = render_vlm_study_line(report)
    assert "no arm reads the scenes" in line and "counting 25.0% vs 20.0%" in line
    assert "compare answer habits, not merges" in line and "(wins)" not in line and "(loses)" not in line
    report["recipe"] = {"stages": [{"steps": 600, "micro_batch": 16, "data": ["../scenes/scenes_captions.json"]},
                                   {"steps": 700, "micro_batch": 16, "data": ["../scenes/scenes_train.json"]}],
                        "tower": {"pretrained": "data/scenes/tower.safetensors", "frozen": ["projector", "vision"]}}
    line = render_vlm_study_line(report)  # the training recipe moves with the report too
    assert line.startswith(f"{len(report['seeds'])} seeds, 600 steps on scenes_captions.json, then 700 steps x "
                           "micro-batch 16, the pretrained scene tower frozen per arm on the same samples in the "
                           "same order (checked): ")
    report["data_checks"][-1]["same_samples"] = False  # one seed's arms saw different samples: said first
    line = render_vlm_study_line(report)
    assert line.startswith("**not a fair comparison**: the arms' training samples differ (the report's same-data "
                           f"check fails); {len(report['seeds'])} seeds, 600 steps") and "(checked)" not in line
    del report["data_checks"]
    assert "(the report's same-data check is missing)" in render_vlm_study_line(report)


def test_each_figure_names_the_cpu_its_file_records():
    """Issue 39: README's figures came from another CPU than a new user's, and did not say which. Every
    rendered sentence names the CPU model its result file records; a file from before the writers recorded
    it says 'CPU not recorded'."""
    summary, run = _load("summary.json"), _load("run.json")
    cpu = "Intel(R) Xeon(R) Platinum 8480+"
    with_cpu = figures.render_train({**summary, "machine": {"cpu": cpu, "cpu_count": 16}}, run)
    assert f", {cpu}, 16 cores;" in with_cpu
    old = {k: v for k, v in summary.items() if k != "machine"}
    assert ", CPU not recorded, " in figures.render_train(old, run)
    unit = json.loads((figures.TESTS / "unit.json").read_text())
    assert f"on {cpu}, " in figures.render_tests({**unit, "cpu": cpu})
    assert "on CPU not recorded, " in figures.render_tests({k: v for k, v in unit.items() if k != "cpu"})
    prefill, decode = (json.loads((figures.BENCH / f"{name}.json").read_text()) for name in ("prefill", "decode"))
    prefill["machine"]["cpu"] = cpu
    assert f"\n\n{cpu}, " in figures.render_bench(prefill, decode)
    del prefill["machine"]["cpu"]
    assert "\n\nCPU not recorded, " in figures.render_bench(prefill, decode)
    overhead = json.loads((figures.BENCH / "overhead.json").read_text())
    del overhead["machine"]["cpu"]
    assert "; CPU not recorded, " in figures.render_overhead(overhead)


def test_the_writers_record_the_cpu_model(tmp_path, monkeypatch):
    """What the renderer reads is written: summary.json's machine (vlm/training/callbacks/end_of_run.py) and
    scripts/test_timing.py's record carry the CPU model name; the benchmarks' machine_info has it too."""
    import subprocess
    import types

    from benchmarks.machine import machine_info
    from vlm.training.callbacks.end_of_run import machine
    from vlm.training.peak import cpu_model

    assert machine() == {"cpu": cpu_model(), "cpu_count": __import__("os").cpu_count()} and cpu_model()
    spec = importlib.util.spec_from_file_location("test_timing", REPO_ROOT / "scripts" / "test_timing.py")
    timing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timing)

    def fake_run(cmd, **kwargs):
        return types.SimpleNamespace(stdout="3 passed in 1.0s\n" if "pytest" in cmd else "abc1234\n", returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(timing, "OUT", tmp_path)
    assert timing.main(["unit"]) == 0
    rec = json.loads((tmp_path / "unit.json").read_text())
    assert rec["cpu"] == cpu_model() and rec["passed"] == 3
    import torch

    assert machine_info(torch.device("cpu"))["cpu"]
