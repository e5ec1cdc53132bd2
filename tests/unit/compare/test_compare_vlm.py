"""vlm.compare's VLM study (issue 40) at smoke size: the six arms (all patches; pixel shuffle, pooling,
pruning to 16 tokens on a plain MoE; ConceptMoE image R=4 on all patches; pixel shuffle + ConceptMoE R=2)
train 2 steps each on scenes built here, with the LLM FLOPs per sample matched by the accountant, the same
samples in the same order, per-kind accuracy, prefill timing, image use (token spread, answer shift), the plot and the chunker's
pictures."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
needs_data = pytest.mark.skipif(not (ROOT / "data" / "default" / "tokenizer").is_dir(),
                                reason="default data not built (make data)")


@pytest.mark.integration  # ~35 s: six arms trained, exported, evaluated and probed
@needs_data
def test_vlm_smoke_study(tmp_path, monkeypatch):
    from data_pipelines.scene_data import build
    from vlm.compare.cli import main

    scenes = tmp_path / "scenes"
    build(str(scenes), seed=0, sizes={"train": 40, "val": 2, "test": 10}, quiet=True)
    monkeypatch.chdir(ROOT)
    out = tmp_path / "cmp"
    data = (f"train.data.datasets=[{{name: scenes_train, type: llava_json, path: {scenes}/scenes_train.json, "
            f"image_root: {scenes}/images, weight: 1.0}}]")
    captions = (f"first_stage.data.datasets=[{{name: scene_captions, type: llava_json, path: {scenes}/scenes_captions.json, "
                f"image_root: {scenes}/images, weight: 1.0}}]")
    assert main(["--config", "configs/compare/vlm_smoke.yaml", "--out", str(out), data, captions,
                 f"train.eval.vqa_json={scenes}/scenes_test.json", f"train.eval.image_root={scenes}/images"]) == 0
    report = json.loads((out / "report.json").read_text())
    md = (out / "report.md").read_text()

    arms = {r["arm"]: r for r in report["arms"]}
    assert list(arms) == ["a", "b", "c", "d", "e", "f"]
    assert {a: r["image_tokens"] for a, r in arms.items()} == {"a": 64, "b": 16, "c": 16, "d": 16, "e": 64, "f": 16}
    for a in "bcd":  # matched to the anchor e within tolerance, one language model for b, c, d
        assert abs(arms[a]["flops_rel"]) <= 0.03 and arms[a]["match_ok"], arms[a]
        assert arms[a]["top_k"] == arms["b"]["top_k"] > arms["a"]["top_k"]
    assert arms["f"]["at_limit"] and arms["f"]["flops_rel"] < -0.03 and "**LIMIT**" in md
    assert report["match_ok"] is True
    runs = {r["arm"]: r for r in report["runs"]}
    scored = json.loads((scenes / "scenes_test.json").read_text())[:12]
    for a, r in runs.items():  # the accountant's LLM params == the built model's numel
        assert arms[a]["lm_params"] == r["params_measured"]["lm"] + r["params_measured"].get("chunker", 0), a
        assert r["steps"] == 2 and r["vqa"]["total"] == 12
        assert set(r["vqa"]["by_kind"]) == {x["group"] for x in scored}  # breakdown by kind|clutter|glyph_size
    assert [d["same_samples"] for d in report["data_checks"]] == [True]
    assert [(f["stage"], f["arm"], f["max_length"]) for f in report["data_fit"]] == [("first", "a", 144), ("second", "a", 144)]
    assert "second stage: the longest record of" in md and "no sample is cut" in md
    assert "min wall, its 6 runs " in md and " min summed (" in md  # a rerun that reuses runs still states their time
    for a, r in runs.items():  # captions first, then the questions from that stage's export
        assert r["first_stage"]["steps"] == 1 and "+" in r["text_fingerprint"], a
        train_cfg = json.loads((Path(r["run_dir"]) / "train_config.json").read_text())
        assert train_cfg["model"]["init_from"] == str(out / "runs" / f"{r['arm_name']}-s0-first" / "hf")
        assert (out / "runs" / f"{r['arm_name']}-s0-first" / "hf" / "config.json").is_file()
    assert "after a first stage of 1 steps" in md and "scenes_captions.json" in md
    assert [st["steps"] for st in report["recipe"]["stages"]] == [1, 2]
    assert report["recipe"]["tower"] == {"pretrained": None, "frozen": []}
    assert "Vision tower: random init (`vision.pretrained: null`); nothing frozen." in md
    assert runs["a"]["data_fingerprint"] != runs["b"]["data_fingerprint"]  # 64 vs 16 image tokens per image

    for a in arms:  # prefill measured for every arm; concepts drawn for the chunking arms
        assert report["probe"][a]["prefill_ms_per_sample"] > 0
    for a in "ef":
        assert (out / "pictures" / report["probe"][a]["pictures"][0]["file"]).is_file()
        assert 0 <= report["probe"][a]["boundary_rate_glyph"] <= 1
    scored_images = [x for x in json.loads((scenes / "scenes_test.json").read_text()) if x.get("image")][:8]
    for a in arms:  # every run's export measured on the same image records (eval.image_use: 8)
        use = report["image_use"][a]["0"]
        assert use["records"] == len(scored_images) >= 2 and use["patch_spread"] > 0 and use["tv"] > 0, (a, use)
        assert report["image_use_stats"][a]["tv"]["mean"] == use["tv"]
        assert f"| {a} | 1 | " in md.split("## Does each arm read the image?")[1]
    assert "answers from the question alone" in md
    assert report["plot"] == "accuracy_vs_flops.png" and (out / "accuracy_vs_flops.png").read_bytes()[:4] == b"\x89PNG"
    for heading in ("Matched compute", "Held-out accuracy per question kind", "Paired differences",
                    "Where learned merging wins or loses", "Prefill time", "Does each arm read the image?",
                    "Accuracy vs inference FLOPs"):
        assert heading in md
    assert "| e - c |" in md and "| answer prior |" in md and "| question-only prior |" in md


@pytest.mark.parametrize("name", ["vlm_smoke", "vlm_cpu", "vlm_gpu"])
def test_vlm_presets_up_to_date_and_matched(name):
    """configs/model/compare/cmp_<name>_*.yaml equal a fresh solve (mode 'check' writes nothing); every
    arm with match_to is within tolerance of it or at the top-k limit (flagged in the report)."""
    from vlm.compare import vlm_match
    from vlm.compare.config import load_compare, train_raw
    from vlm.compare.presets import build_presets, seq_len_of

    cfg = load_compare(ROOT / "configs" / "compare" / f"{name}.yaml")
    raw = train_raw(cfg)
    presets = build_presets(cfg, raw, mode="check")
    grid = vlm_match.patch_grid(cfg["vlm"]["vision"])
    rows = vlm_match.match_rows(cfg, {a: p["lm_cfg"] for a, p in presets.items()}, grid, seq_len_of(cfg, raw), {})
    assert min(r["image_tokens"] for r in rows) >= 16 and max(r["image_tokens"] for r in rows) >= 64
    for r in rows:
        lm = presets[r["arm"]]["lm_cfg"]
        assert r.get("match_ok", True) or lm.top_k == lm.num_experts, r


def test_vlm_config_errors():
    from vlm.compare.config import load_compare
    from vlm.modeling.config_base import ConfigError

    smoke = ROOT / "configs" / "compare" / "vlm_smoke.yaml"
    with pytest.raises(ConfigError, match=r"match\.text_tokens: is required by solve 'sample'"):
        load_compare(smoke, ["match.text_tokens=null"])
    with pytest.raises(ConfigError, match=r"arms\[1\]\.solve: 'sample' needs study: vlm"):
        load_compare(smoke, ["study=lm"])
    with pytest.raises(ConfigError, match=r"match_to: must name an earlier arm"):
        load_compare(smoke, ["arms=[{id: a, name: full}, {id: b, name: x, solve: sample, match_to: z}]"])
    with pytest.raises(ConfigError, match=r"first_stage\.model\.preset: the arms define the model in both stages"):
        load_compare(smoke, ["first_stage.model.preset=configs/model/vlm_tiny.yaml"])


def test_missing_tower_file_is_one_line(tmp_path, monkeypatch, capsys):
    from vlm.compare.cli import main

    monkeypatch.chdir(ROOT)
    missing = tmp_path / "tower.safetensors"
    assert main(["--config", "configs/compare/vlm_smoke.yaml", "--out", str(tmp_path / "cmp"), "--dry-run",
                 f"vlm.vision.pretrained={missing}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: vision.pretrained: weights file not found: {missing}"


@pytest.mark.parametrize("config", ["configs/compare/vlm_smoke.yaml", "configs/compare/vlm_cpu.yaml",
                                    "configs/compare/vlm_gpu.yaml", "configs/train/scenes.yaml"])
@needs_data
def test_eval_generates_enough_tokens_for_every_answer(config, tmp_path):
    """Greedy eval stops at eval.max_new_tokens: an answer longer than that (with its <|end|>) can never
    be scored right ("bottom-right" is 6 tokens of the default tokenizer)."""
    import yaml
    from transformers import AutoTokenizer

    from data_pipelines.scene_data import build

    raw = yaml.safe_load((ROOT / config).read_text())
    max_new = (raw.get("train", raw) if "study" in raw else raw)["eval"]["max_new_tokens"]
    build(str(tmp_path / "s"), seed=0, sizes={"train": 30, "val": 1, "test": 1}, quiet=True)
    tok = AutoTokenizer.from_pretrained(str(ROOT / "data" / "default" / "tokenizer"))
    from data_pipelines.scene_data import TRAIN_ONLY_KINDS

    answers = {r["conversations"][1]["value"] for r in json.loads((tmp_path / "s" / "scenes_train.json").read_text())
               if r["kind"] not in TRAIN_ONLY_KINDS}
    longest = max(len(tok(a + "<|end|>")["input_ids"]) for a in answers)
    assert longest <= max_new, f"{config}: eval.max_new_tokens={max_new} < {longest} tokens of the longest answer"


def test_text_fingerprint_ignores_how_samples_are_packed():
    """The same samples of a step packed into rows differently (first-fit packing depends on the image
    tokens per image, which the VLM arms differ in) give the same text fingerprint; other samples do not."""
    import torch

    from vlm.compare.jobs import _FingerprintLoader

    IMG, PAD = 2, 0
    s1, s2, s3 = [10, IMG, IMG, 11], [12, 13, IMG], [14, IMG, 15, 16]

    def batch(rows):
        width = max(sum(len(s) for s in row) for row in rows)
        ids, seg = torch.full((len(rows), width), PAD), torch.zeros(len(rows), width, dtype=torch.long)
        for r, row in enumerate(rows):
            col = 0
            for k, s in enumerate(row, start=1):
                ids[r, col:col + len(s)] = torch.tensor(s)
                seg[r, col:col + len(s)] = k
                col += len(s)
        return {"input_ids": ids, "segment_ids": seg}

    def digest(*batches):
        fp = _FingerprintLoader(list(batches), [IMG, PAD])
        list(fp)
        return fp.text_digest

    one_per_row = digest(batch([[s1], [s2], [s3]]))
    assert digest(batch([[s1, s3], [s2]])) == one_per_row  # first fit put s3 beside s1
    assert digest(batch([[s2, s1], [s3]])) == one_per_row
    assert digest(batch([[s1], [s2], [s2]])) != one_per_row  # a different sample
    assert digest(batch([[s1], [s2]]), batch([[s3]])) != one_per_row  # s3 in the next step


def test_question_only_prior_names_what_the_question_alone_gives(tmp_path):
    """A model that answers every comparison with one of the two quadrants the question names scores about
    50% with no image: the question-only prior (each text's most frequent training answer) says so, the
    per-kind answer prior does not; without a training split beside the eval file it is n/a, not a guess."""
    from vlm.compare.vlm_report import _groups

    def rec(kind, q, a):
        return {"kind": kind, "group": f"{kind}|clean|small", "conversations": [{"value": q}, {"value": a}]}

    top = "Which digit is larger, the top-left or the top-right?"
    bottom = "Which digit is larger, the bottom-left or the bottom-right?"
    unseen = "Which digit is larger, the top-left or the bottom-right?"
    train = [rec("comparison", top, "top-right")] * 3 + [rec("comparison", top, "top-left")] * 2
    train += [rec("comparison", bottom, "bottom-left")] * 2 + [rec("comparison", bottom, "bottom-right")]
    scored = [rec("comparison", top, a) for a in ("top-left", "top-right", "top-left", "top-right")]
    scored += [rec("comparison", bottom, a) for a in ("bottom-left", "bottom-right", "bottom-left", "bottom-left")]
    scored += [rec("comparison", unseen, "top-right")]  # never asked in training: the kind's top answer
    (tmp_path / "s_train.json").write_text(json.dumps(train))
    (tmp_path / "s_test.json").write_text(json.dumps(scored))
    counts, prior, prior_question = _groups({"eval": {"vqa_json": str(tmp_path / "s_test.json"), "limit": None}})
    assert sum(counts.values()) == 9
    assert prior["comparison"] == 3 / 9  # "bottom-left", the most frequent scored answer of the kind
    assert prior_question["comparison"] == (2 + 3 + 1) / 9  # top-right x2, bottom-left x3, unseen -> top-right
    assert prior["identity"] is None and prior_question["identity"] is None
    (tmp_path / "s_train.json").unlink()
    assert _groups({"eval": {"vqa_json": str(tmp_path / "s_test.json"), "limit": None}})[2]["comparison"] is None


def test_recipe_names_the_tower_and_its_pretraining(tmp_path):
    from vlm.compare.vlm_report import recipe, tower_line

    weights = tmp_path / "tower.safetensors"
    weights.write_bytes(b"")
    (tmp_path / "tower.json").write_text(json.dumps({"steps": 3000, "held_out_accuracy": {"glyph": 0.887,
                                                                                         "colour": 1.0}}))
    cfg = {"vlm": {"vision": {"pretrained": str(weights)}},
           "first_stage": {"data": {"datasets": [{"path": "caps.json"}]}, "train": {"max_steps": 5}}}
    raw = {"train": {"max_steps": 7, "micro_batch_size": 4, "freeze": {"vision": True, "projector": False}},
           "data": {"datasets": [{"path": "qa.json"}]}}
    how = recipe(cfg, raw)
    assert how["stages"] == [{"steps": 5, "micro_batch": 4, "data": ["caps.json"]},
                             {"steps": 7, "micro_batch": 4, "data": ["qa.json"]}]
    assert how["tower"]["frozen"] == ["vision"] and how["tower"]["pretraining"]["steps"] == 3000
    assert tower_line(how["tower"]) == (f"Vision tower: `{weights}` (`make scene-tower`); its pretraining: glyph 88.7%, "
                                        "colour 100.0% of held-out patches right after 3000 steps; frozen: vision.")
