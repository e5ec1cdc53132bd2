"""The VLM study's same-data guard (vlm.compare.data_fit): a training record that a 64-image-token arm's
row would cut, while a 16-token arm's row holds it whole, stops the study before training with one line
naming the record and the max_length that fits; the committed CPU study's rows hold every scene record."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
needs_data = pytest.mark.skipif(not (ROOT / "data" / "default" / "tokenizer").is_dir(),
                                reason="default data not built (make data)")


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    from data_pipelines.scene_data import build

    out = tmp_path_factory.mktemp("scenes") / "scenes"
    build(str(out), seed=0, sizes={"train": 30, "val": 2, "test": 2}, quiet=True)
    return out


def _overrides(scenes: Path) -> list[str]:
    return [(f"train.data.datasets=[{{name: scenes_train, type: llava_json, path: {scenes}/scenes_train.json, "
             f"image_root: {scenes}/images, weight: 1.0}}]"),
            (f"first_stage.data.datasets=[{{name: scene_captions, type: llava_json, "
             f"path: {scenes}/scenes_captions.json, image_root: {scenes}/images, weight: 1.0}}]")]


def _longest_with(scenes: Path, image_tokens: int) -> int:
    """Longest record, the way the collator sees it: the trainer's chat tokenizer with the arm's image tokens."""
    from transformers import AutoTokenizer

    from vlm.modeling.chat_template import ChatTokenizer

    chat = ChatTokenizer(AutoTokenizer.from_pretrained(str(ROOT / "data/default/tokenizer")), image_tokens)
    recs = json.loads((scenes / "scenes_train.json").read_text())
    return max(len(chat.encode_conversation(r["conversations"], r["id"], num_images=1 if r.get("image") else 0)[0])
               for r in recs)


@needs_data
def test_cpu_study_rows_hold_every_record(scenes, monkeypatch):
    from vlm.compare.config import load_compare, train_raw
    from vlm.compare.data_fit import check_study

    monkeypatch.chdir(ROOT)
    cfg = load_compare(ROOT / "configs/compare/vlm_cpu.yaml", _overrides(scenes))
    rows = check_study(cfg, train_raw(cfg))
    assert [r["stage"] for r in rows] == ["first", "second"]
    longest = _longest_with(scenes, 64)
    assert longest > 128  # the rows of 128 the study had cut these captions for arms a and e only
    assert _longest_with(scenes, 16) <= 128
    assert rows[1]["tokens"] == longest <= rows[1]["max_length"] == 144 and rows[1]["arm"] == "a"
    assert rows[0]["tokens"] <= longest  # the captions are part of the question stage's file


@needs_data
def test_cut_rows_stop_the_study_with_one_line(scenes, monkeypatch, capsys, tmp_path):
    from vlm.compare.cli import main

    monkeypatch.chdir(ROOT)
    longest = _longest_with(scenes, 64)
    rc = main(["--config", "configs/compare/vlm_cpu.yaml", "--dry-run", "--out", str(tmp_path / "out"),
               *_overrides(scenes), "train.data.max_length=128", "vlm.vision.pretrained=null"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: data: first stage: record train-") and "with arm a's 64 image tokens" in err[0]
    assert err[0].endswith(f"set train.data.max_length to at least {longest}")
    assert not (tmp_path / "out").exists()  # nothing written, nothing trained


@needs_data
def test_missing_training_file_is_one_line(monkeypatch, capsys, tmp_path):
    from vlm.compare.cli import main

    monkeypatch.chdir(ROOT)
    gone = tmp_path / "nope.json"
    rc = main(["--config", "configs/compare/vlm_smoke.yaml", "--dry-run", "--out", str(tmp_path / "out"),
               *(f"{stage}.data.datasets=[{{name: x, type: llava_json, path: {gone}, weight: 1.0}}]"
                 for stage in ("train", "first_stage"))])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"error: data: training file not found: {gone}"]
    (tmp_path / "empty.json").write_text("[]")
    rc = main(["--config", "configs/compare/vlm_smoke.yaml", "--dry-run", "--out", str(tmp_path / "out"),
               "train.data.datasets=[{name: x, type: llava_json, path: ../nope/x.json, weight: 1.0}]",
               f"first_stage.data.datasets=[{{name: x, type: llava_json, path: {tmp_path}/empty.json, weight: 1.0}}]"])
    err = capsys.readouterr().err.strip().splitlines()  # relative to data.config's root, '..' resolved
    assert rc == 2 and err == [f"error: data: training file not found: {ROOT / 'data' / 'nope' / 'x.json'}"]
