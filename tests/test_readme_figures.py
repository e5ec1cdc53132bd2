"""The README's demo figures are the committed run files' (docs/results/train-vlm/, written by make train-vlm
and make eval, copied by scripts/readme_figures.py --publish), not hand edits: any drift fails here."""
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
    spans = figures.readme_spans(figures.README.read_text(encoding="utf-8"))
    expected = figures.rendered()
    assert set(spans) == {"train", "eval"}
    for key, text in expected.items():
        assert spans[key] == text, f"README figures:{key} differ from docs/results/train-vlm/ " \
                                   f"(python scripts/readme_figures.py --publish ...):\n  README: {spans[key]}\n  files:  {text}"
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
