"""The training / compare command lines: dotted overrides may stand before, between or after flags
(intermixed parsing), and a missing data file stops ``vlm.train`` with one line naming its key
(``data.datasets[i].path``) before anything is built (exit 2)."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
TRAIN_YAML = ROOT / "configs" / "train" / "default.yaml"


def test_train_overrides_after_a_flag():
    from vlm.train import parse_args

    args = parse_args(["--config", "c.yaml", "train.lr=1e-3", "--resume", "auto", "train.grad_accum=2", "--no-eval",
                       "seed=3"])
    assert args.config == "c.yaml" and args.resume == "auto" and args.no_eval
    assert args.overrides == ["train.lr=1e-3", "train.grad_accum=2", "seed=3"]


def test_compare_overrides_after_a_flag():
    from vlm.compare.cli import parse_args

    args = parse_args(["--config", "c.yaml", "--seeds", "2", "name=x", "--dry-run", "train.max_steps=5"])
    assert args.seeds == 2 and args.dry_run and args.overrides == ["name=x", "train.max_steps=5"]


def _main(argv, capsys, caplog, monkeypatch) -> tuple[int, str, str]:
    from vlm import train

    monkeypatch.setitem(sys.modules, "wandb", sys.modules.get("wandb"))  # main() hides wandb: undone after
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    caplog.set_level(logging.INFO, logger="vision_encoders")
    code = train.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


def test_missing_dataset_file_is_one_line_before_the_model(tmp_path, capsys, caplog, monkeypatch):
    """A missing file named in data.datasets (given after a flag): exit 2, one line with the key and
    the path as the loader would open it, and no model built (no load lines, nothing printed)."""
    override = "data.datasets=[{name: a, type: llava_json, path: digits_train.json}, {type: text, path: gone.txt}]"
    root = tmp_path / "d"
    root.mkdir()
    (root / "digits_train.json").write_text("[]")
    code, out, err = _main(["--config", str(TRAIN_YAML), "--no-eval", f"data.root={root}", override,
                            f"output_dir={tmp_path}"], capsys, caplog, monkeypatch)
    assert code == 2 and "\n" not in err, err
    assert err == f"error: config error: data.datasets[1].path: file not found: {root / 'gone.txt'}"
    assert "[model]" not in out and "[train]" not in out, out
    assert not [r for r in caplog.records if r.name == "vision_encoders"]


def test_missing_file_of_the_data_yaml_and_eval_split(tmp_path, capsys, caplog, monkeypatch):
    data_yaml = tmp_path / "data.yaml"
    data_yaml.write_text(yaml.safe_dump({"root": str(tmp_path), "datasets": [
        {"type": "llava_json", "path": "v.json", "image_root": "no_images"}]}))
    (tmp_path / "v.json").write_text("[]")
    base = ["--config", str(TRAIN_YAML), f"data.config={data_yaml}", "data.datasets=null", "data.root=null",
            f"output_dir={tmp_path}"]
    code, out, err = _main(base, capsys, caplog, monkeypatch)
    assert code == 2 and err == (f"error: config error: data.datasets[0].image_root (in data.config {data_yaml}): "
                                 f"folder not found: {tmp_path / 'no_images'}"), err
    (tmp_path / "no_images").mkdir()
    code, out, err = _main([*base, f"eval.vqa_json={tmp_path / 'test.json'}"], capsys, caplog, monkeypatch)
    assert code == 2 and err == f"error: config error: eval.vqa_json: file not found: {tmp_path / 'test.json'}", err
    assert "[model]" not in out and "[train]" not in out, out
    assert not [r for r in caplog.records if r.name == "vision_encoders"]


@pytest.mark.parametrize("missing", ["shards", "one shard"])
def test_missing_webdataset_shards(tmp_path, missing, capsys, caplog, monkeypatch):
    (tmp_path / "s-000.tar").write_bytes(b"")
    pattern = "s-{000..001}.tar" if missing == "one shard" else "none-*.tar"
    override = f"data.datasets=[{{type: webdataset, path: '{pattern}'}}]"
    code, out, err = _main(["--config", str(TRAIN_YAML), f"data.root={tmp_path}", override, "--no-eval",
                            f"output_dir={tmp_path}"], capsys, caplog, monkeypatch)
    want = (f"shard not found: {tmp_path / 's-001.tar'}" if missing == "one shard"
            else f"no shards found: {tmp_path / pattern}")
    assert code == 2 and err == f"error: config error: data.datasets[0].path: {want}", err
