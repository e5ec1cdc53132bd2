"""A user's own LLaVA JSON with bad records, as a new user meets it (issue 15 item 6): the first skips
of each reason printed with record id and file#index, skip counts per reason in the summary table
(apart from skipped optimizer steps), the bad-data stop as one stderr line with exit 2, the held-out
breakdown by a configurable record field, and one progress line per log step without the bar."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import _train_helpers as helpers
import pytest
from _data_helpers import tiny_tokenizer, write_image, write_llava

from vlm.modeling.chat_common import Skip

MISSING = (9, 10, 11, 12)  # four missing images: one more than are printed per reason
CORRUPT = 5


def _user_data(root: Path) -> dict:
    """22 records (kinds digit / parity), record 5's image corrupt, records 9-12's images missing;
    a clean 6-record eval split; a tiny tokenizer."""
    images = root / "images"
    records = []
    for i in range(22):
        write_image(str(images / f"{i}.png"), value=10 * i)
        kind = "digit" if i % 2 == 0 else "parity"
        question, answer = (("What digit is this?", str(i % 10)) if kind == "digit"
                            else ("Is it even or odd?", "even" if i % 2 == 0 else "odd"))
        records.append({"id": f"user-{i}", "kind": kind, "image": f"{i}.png", "conversations": [
            {"from": "human", "value": f"<image>\n{question}"}, {"from": "gpt", "value": answer}]})
    (images / f"{CORRUPT}.png").write_bytes(b"this is not a png")
    for i in MISSING:
        (images / f"{i}.png").unlink()
    write_llava(str(root / "mine.json"), records)
    write_llava(str(root / "mine_eval.json"), [records[i] for i in (0, 1, 2, 3, 4, 6)])
    tiny_tokenizer(str(root / "tok"))
    return {"json": root / "mine.json", "eval": root / "mine_eval.json", "images": images, "tok": root / "tok"}


def _raw(tmp: Path, files: dict, **sections) -> dict:
    base = helpers.config(tmp, base=helpers.TINY_VLM, name="mine",
                          model={"tokenizer": str(files["tok"])},
                          data={"kind": "mixture", "max_length": 40,
                                "datasets": [{"name": "mine", "type": "llava_json", "path": str(files["json"]),
                                              "image_root": str(files["images"])}]},
                          train={"max_steps": 3, "micro_batch_size": 8},
                          checkpoint={"every_steps": 0, "save_final": False, "export_hf": False})
    return helpers.config(tmp, base=base, **sections)


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
    """One in-process run over exactly one pass of the data (22 positions = 3 micro-batches of 8),
    the progress bar off, the held-out eval broken down by `kind`; its stdout is captured."""
    tmp = tmp_path_factory.mktemp("user_run")
    data = _user_data(tmp)
    raw = _raw(tmp, data, data={"num_samples": 22},
               eval={"vqa_json": str(data["eval"]), "image_root": str(data["images"]), "limit": 6,
                     "batch_size": 6, "max_new_tokens": 2, "breakdown_by": "kind"})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        tr = helpers.run_inprocess(raw, tmp, finish=True)
    return {"trainer": tr, "out": out.getvalue(), "run": tmp / "mine", "data": data}


def test_first_skips_of_each_reason_are_printed_with_id_and_path(user_run):
    out, data = user_run["out"], user_run["data"]
    lines = [line for line in out.splitlines() if line.startswith("[data] skipped sample")]
    corrupt = [line for line in lines if "corrupt_image" in line]
    missing = [line for line in lines if "missing_image" in line]
    assert len(corrupt) == 1 and len(missing) == 3, out  # 4 missing: 3 printed, the rest counted
    assert f"record user-{CORRUPT} ({data['json']}#{CORRUPT})" in corrupt[0]
    assert str(data["images"] / f"{CORRUPT}.png") in corrupt[0]
    for line in missing:
        i = int(line.split("record user-")[1].split(" ")[0])
        assert i in MISSING and f"({data['json']}#{i})" in line
        assert f"image {data['images'] / f'{i}.png'} not found" in line
    assert "further missing_image skips are only counted" in missing[-1]


def test_summary_counts_skipped_samples_per_reason_apart_from_steps(user_run):
    out, run = user_run["out"], user_run["run"]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in out.splitlines()
            if line.startswith("| ") and line.count("|") == 3}
    assert rows["optimizer steps"] == "3 (0 skipped: non-finite)"
    assert rows["skipped samples (bad data)"] == str(1 + len(MISSING))
    assert rows["missing_image"] == str(len(MISSING)) and rows["corrupt_image"] == "1"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["skipped_samples"] == {"missing_image": len(MISSING), "corrupt_image": 1}
    assert summary["skipped_steps"] == 0


def test_eval_breakdown_by_a_record_field(user_run):
    out, run, tr, data = user_run["out"], user_run["run"], user_run["trainer"], user_run["data"]
    result = json.loads((run / "summary.json").read_text())["eval"]
    assert result["breakdown_by"] == "kind" and set(result["by_kind"]) == {"digit", "parity"}
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("|   ")]
    assert "digit" in rows and "parity" in rows  # not the id suffix ("0", "1", ...)
    from eval_suites.digits_vqa import digits_vqa_accuracy

    module = tr.engine.module
    plain = digits_vqa_accuracy(module, tr.processor, str(data["eval"]), str(data["images"]), limit=3,
                                batch_size=3, max_new_tokens=1)
    assert plain["by_kind"] == {} and plain["total"] == 3  # default: no breakdown
    by_id = digits_vqa_accuracy(module, tr.processor, str(data["eval"]), str(data["images"]), limit=3,
                                batch_size=3, max_new_tokens=1, breakdown_by="id")
    assert set(by_id["by_kind"]) == {"user-0", "user-1", "user-2"}
    odd = digits_vqa_accuracy(module, tr.processor, str(data["eval"]), str(data["images"]), limit=2,
                              batch_size=2, max_new_tokens=1, breakdown_by="no_such_field")
    assert odd["by_kind"] == {} and odd["breakdown_missing"] and odd["total"] == 2  # no "(none)" group
    from vlm.training.callbacks.end_of_run import summary_table

    table = summary_table("mine", tr.progress, 1.0, 1.0, odd)
    assert "(none)" not in table and "| " + "  by no_such_field" in table and "no record has this field" in table
    assert "breakdown_missing" not in plain and "breakdown_missing" not in by_id


def test_progress_lines_without_the_bar(user_run):
    lines = [line for line in user_run["out"].splitlines() if line.startswith("[train] step ")
             and " loss " in line]
    assert [line.split()[2] for line in lines] == ["1/3", "2/3", "3/3"], user_run["out"]
    assert all("tokens/s" in line and " R " in line for line in lines)  # vlm_tiny chunks: R is logged
    assert "skipped samples" in lines[-1]


def test_default_config_breaks_the_digits_down_by_kind():
    from data_pipelines.default_data import QUESTIONS
    from vlm.config.train import REPO_ROOT, load_train_config

    cfg = load_train_config(REPO_ROOT / "configs" / "train" / "default.yaml")
    assert cfg.eval.breakdown_by == "kind"
    assert load_train_config(raw={"data": {"kind": "synthetic"}}).eval.breakdown_by is None
    import inspect

    from data_pipelines import default_data

    assert '"kind": key' in inspect.getsource(default_data.build_digits)
    assert {k for k, _, _ in QUESTIONS} == {"digit", "parity", "plus_one"}


def test_skip_describe_is_one_line():
    skip = Skip("missing_image", "r1", "image /x/1.png not found", where="/x/data.json#1")
    assert skip.describe() == "missing_image: record r1 (/x/data.json#1): image /x/1.png not found"
    assert skip == Skip("missing_image", "r1", "image /x/1.png not found")  # `where` is not compared


@pytest.mark.integration  # launches vlm.train
def test_too_much_bad_data_is_one_line_and_exit_2(tmp_path):
    data = _user_data(tmp_path)
    raw = _raw(tmp_path, data, name="bad", data={"min_samples_for_bad_check": 16, "max_bad_fraction": 0.01},
               train={"max_steps": 4})
    path = helpers.write_config(tmp_path, raw, "bad.yaml")
    proc = helpers.launch(path, launcher="python", timeout=240)
    assert proc.returncode == 2, proc.stdout[-4000:]
    assert "Traceback" not in proc.stdout
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: too much bad data on rank 0: "), proc.stdout[-4000:]
    assert "data.max_bad_fraction" in errors[0] and "missing_image=" in errors[0]
