"""The model's runtime choices (vlm/modeling/runtime.py, ``ConceptMoEConfig.runtime``) and the GPU verdicts
that ``auto`` follows on CUDA (vlm/modeling/verdicts.py, gpu_verdicts.json, scripts/gpu/verdicts.py)."""
from __future__ import annotations

import json

import pytest
from conftest import build_model, runtime
from test_host_layout import _packed

from scripts.gpu import verdicts as gpu_verdicts
from vlm.config.train import load_train_config
from vlm.modeling import fused_kernels as fk
from vlm.modeling import syncs, verdicts
from vlm.modeling.chunking import CONCEPT_SYNC
from vlm.modeling.config_base import ConfigError
from vlm.modeling.configuration_conceptmoe import ConceptMoEConfig
from vlm.modeling.runtime import RuntimeOptions, scan_impl, use_tokens_capacity
from vlm.modeling.varlen import DocLayout
from vlm.training.build import build_model_config


# the config: set from a preset, a training override or the live object; one model's own -----------------
@pytest.mark.parametrize("kind", ["lm", "vlm"])
def test_training_overrides_reach_the_model_config(kind):
    cfg = load_train_config("configs/train/default.yaml", overrides=[
        f"model.kind={kind}", f"model.preset=configs/model/{'tiny_concept' if kind == 'lm' else 'vlm_tiny'}.yaml",
        "model.runtime.capacity=exact", "model.runtime.varlen_kernel=bucketed",
        "model.runtime.concept_headroom=4"])
    config = build_model_config(cfg)
    opts = getattr(config, "text_config", config).runtime
    assert (opts.capacity, opts.varlen_kernel, opts.concept_headroom, opts.ema_scan) == ("exact", "bucketed", 4, "auto")


def test_a_bad_runtime_choice_is_one_line():
    cfg = load_train_config("configs/train/default.yaml", overrides=[
        "model.kind=lm", "model.preset=configs/model/tiny_concept.yaml", "model.runtime.ema_scan=cuda"])
    with pytest.raises(ConfigError) as err:
        build_model_config(cfg)
    assert "\n" not in str(err.value) and "runtime.ema_scan: input should be 'auto', 'torch' or 'triton', got 'cuda'" \
        in str(err.value)
    with pytest.raises(ConfigError, match=r"^config error: runtime\.kernel: unknown config key \(known here: attention"):
        ConceptMoEConfig.from_dict_sections({"runtime": {"kernel": "loop"}})
    with pytest.raises(ConfigError, match=r"^config error: runtime\.concept_headroom: input should be greater than"):
        ConceptMoEConfig().runtime.concept_headroom = -1


def test_runtime_choices_are_not_saved_in_an_export(tmp_path):
    config = ConceptMoEConfig(runtime={"capacity": "tokens", "attention": "dense"})
    config.save_pretrained(tmp_path)
    assert "runtime" not in json.loads((tmp_path / "config.json").read_text())
    assert ConceptMoEConfig.from_pretrained(tmp_path).runtime == RuntimeOptions()


def test_two_models_in_one_process_keep_their_own_choices():
    """Model A runs its concepts at capacity T (no read of the concept count), model B reads it: each
    forward, interleaved, follows its own config (a module global made them share one)."""
    a = build_model(**{"runtime.capacity": "tokens"}).train()
    b = build_model(**{"runtime.capacity": "exact"}).train()
    assert runtime(a) is not runtime(b)
    batch = _packed()
    layout = DocLayout.on_host(batch["attention_mask"].bool(), batch["segment_ids"])
    for model, reads in ((a, 0), (b, 1), (a, 0)):
        with syncs.counting() as named:
            model(**batch, doc_layout=layout).loss.backward()
        assert named[CONCEPT_SYNC] == reads, (model is a, dict(named))


# the verdicts: auto on CUDA takes a new path only where the GPU check recorded it correct and faster ------
def _table(**marks) -> dict:
    """Every path unmeasured, except ``name=(correct, faster)``."""
    table = verdicts.unmeasured()
    for name, (correct, faster) in marks.items():
        table["paths"][name].update(correct=correct, faster=faster, measured_on="test")
    return table


def test_the_shipped_verdicts_keep_the_reference_paths_on_cuda():
    """Nothing has been measured on a GPU: ``auto`` on a (simulated) CUDA device reads the concept count,
    runs the torch EMA scan and the torch kernels (before: capacity T and the Triton scan, unmeasured)."""
    auto = RuntimeOptions()
    assert not any(verdicts.proven(name) for name in verdicts.PATHS)
    assert not use_tokens_capacity(auto, True, "cuda")
    assert scan_impl(auto, "cuda") == "torch"
    assert fk.auto_on_cuda() == dict.fromkeys(fk.FUSED, "torch")


@pytest.mark.parametrize("marks, picked", [((True, True), True), ((True, False), False), ((False, True), False),
                                           ((True, None), False), ((None, None), False)])
def test_auto_on_cuda_follows_a_verdicts_file(tmp_path, marks, picked):
    """A verdicts file (as the GPU check writes it) marking every path ``marks``: ``auto`` on a simulated
    CUDA device takes the new paths only for correct and faster; the CPU keeps the references."""
    path = tmp_path / "gpu_verdicts.json"
    path.write_text(json.dumps(_table(**dict.fromkeys(verdicts.PATHS, marks))))
    table = verdicts.load(str(path))
    auto = RuntimeOptions()
    assert use_tokens_capacity(auto, True, "cuda", table) is picked
    assert scan_impl(auto, "cuda", table) == ("triton" if picked else "torch")
    assert fk.auto_on_cuda(table) == (dict(fk.FUSED) if picked else dict.fromkeys(fk.FUSED, "torch"))
    assert verdicts.proven("decode_cudagraph", table) is picked
    assert not use_tokens_capacity(auto, True, "cpu", table) and scan_impl(auto, "cpu", table) == "torch"
    # a named choice is taken whatever the verdicts say
    assert scan_impl(RuntimeOptions(ema_scan="triton"), "cuda", verdicts.unmeasured()) == "triton"


def test_one_path_proven_flips_only_that_path():
    table = _table(ema_scan_triton=(True, True))
    assert scan_impl(RuntimeOptions(), "cuda", table) == "triton"
    assert not use_tokens_capacity(RuntimeOptions(), True, "cuda", table)
    assert fk.auto_on_cuda(table) == dict.fromkeys(fk.FUSED, "torch")


def test_a_malformed_verdicts_file_is_one_line(tmp_path):
    path = tmp_path / "v.json"
    bad = _table()
    bad["paths"]["capacity_tokens"]["correct"] = "yes"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"paths\.capacity_tokens\.correct must be true, false or null, got 'yes'$"):
        verdicts.load(str(path))
    del bad["paths"]["capacity_tokens"]
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="'paths' must hold exactly"):
        verdicts.load(str(path))


# the table: rendered by the GPU check, committed for the shipped file ----------------------------------
def test_the_verdict_table_renders_each_path():
    md = verdicts.render(_table(ema_scan_triton=(True, True), capacity_tokens=(True, False)))
    rows = {line.split("`")[1]: line.split(" | ") for line in md.splitlines() if line.startswith("| `")}
    assert set(rows) == set(verdicts.PATHS)
    assert rows["ema_scan_triton"][2:5] == ["yes", "yes", "new path"]
    assert rows["capacity_tokens"][2:5] == ["yes", "no", "reference"]
    assert rows["decode_cudagraph"][2:5] == ["not measured", "not measured", "reference"]


def test_the_committed_table_is_the_committed_file():
    """docs/results/gpu_verdicts.md is regenerated by ``python -m scripts.gpu.verdicts --committed``."""
    want = gpu_verdicts.render_md(verdicts.load(), "vlm/modeling/gpu_verdicts.json (committed)")
    assert gpu_verdicts.COMMITTED_MD.read_text() == want


def test_the_check_on_a_cpu_measures_nothing(tmp_path):
    """The GPU check's step on a CPU: every verdict null, the table 'not measured' throughout."""
    assert gpu_verdicts.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    table = json.loads((tmp_path / "gpu_verdicts.json").read_text())
    verdicts.check_table(table)
    assert all(e["correct"] is None and e["faster"] is None for e in table["paths"].values())
    md = (tmp_path / "gpu_verdicts.md").read_text()
    assert md.count("| not measured | not measured | reference | not measured |") == len(verdicts.PATHS)
