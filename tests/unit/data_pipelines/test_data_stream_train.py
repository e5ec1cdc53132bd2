"""The real trainer on a llava_json + webdataset mixture (2 DataLoader workers): a few steps, a
checkpoint, and a resume that reproduces the uninterrupted run exactly."""

import json

import _train_helpers as helpers
from _data_helpers import digit_record, tiny_tokenizer, write_image, write_llava
from test_data_stream import write_wds_shards


def _raw(tmp, name, **sections):
    base = helpers.config(tmp, base=helpers.TINY_VLM, name=name, model={"tokenizer": str(tmp / "tok")},
                          data={"kind": "mixture", "root": str(tmp), "max_length": 40, "num_workers": 2,
                                "max_bad_fraction": 0.5, "datasets": [
                                    {"name": "vqa", "type": "llava_json", "path": "vqa.jsonl", "weight": 0.5},
                                    {"name": "shards", "type": "webdataset", "path": "wds", "weight": 0.5}]},
                          train={"max_steps": 4, "micro_batch_size": 4},
                          checkpoint={"every_steps": 2, "keep_last": 2, "export_hf": False})
    return helpers.config(tmp, base=base, **sections)


def test_train_on_llava_and_webdataset_then_resume_exactly(tmp_path):
    tiny_tokenizer(str(tmp_path / "tok"))
    for i in range(3):
        write_image(str(tmp_path / f"{i}.png"), "L", value=60 * i)
    write_llava(str(tmp_path / "vqa.jsonl"), [digit_record(i, f"{i % 3}.png", answer=str(i % 10)) for i in range(9)],
                jsonl=True)
    write_wds_shards(tmp_path / "wds", n_shards=4, per_shard=3, bad={f"w{s}_1" for s in range(4)})
    full = helpers.run_inprocess(_raw(tmp_path, "full"), tmp_path)
    ref = helpers.records(tmp_path / "full")
    assert full.step == 4 and [r["step"] for r in ref] == [1, 2, 3, 4]
    state = json.loads((tmp_path / "full" / "ckpt" / "step_000002" / "rank_00000.json").read_text())["data"]
    assert state["readers"] == 2 and set(state["streams"]) == {"shards"}
    assert sum(st["read"] for st in state["streams"]["shards"].values()) > 0
    resumed = helpers.run_inprocess(_raw(tmp_path, "resumed"), tmp_path,  # as if killed after step 2
                                    resume=str(tmp_path / "full" / "ckpt" / "step_000002"))
    rest = helpers.records(tmp_path / "resumed")
    assert resumed.step == 4 and [r["step"] for r in rest] == [3, 4]
    for key in ("loss", "lm_loss", "grad_norm", "tokens"):
        assert [r[key] for r in rest] == [r[key] for r in ref[2:]], key
    skipped = sum(sum(r.get("skipped_samples", {}).values()) for r in ref)
    assert skipped >= 1  # the bad shard record was met and counted


def test_too_few_shards_for_the_readers_is_one_line_exit_2(tmp_path, capsys):
    from vlm.train import main

    tiny_tokenizer(str(tmp_path / "tok"))
    write_image(str(tmp_path / "0.png"), "L")
    write_llava(str(tmp_path / "vqa.jsonl"), [digit_record(0, "0.png")], jsonl=True)
    write_wds_shards(tmp_path / "wds", n_shards=2, per_shard=2)
    path = helpers.write_config(tmp_path, _raw(tmp_path, "few", data={"num_workers": 3}))
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: config error: data: webdataset source 'shards'")
    assert "2 shards for 3 readers" in err[-1]
