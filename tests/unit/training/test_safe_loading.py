"""Loading never unpickles: a planted pickle that would write a marker file when unpickled never
runs, whichever of our loaders meets it.

* model / VLM ``from_pretrained`` (class and Auto class): a folder with only a pickle is refused
  (``UnsafeCheckpoint``); pickles next to ``model.safetensors`` are never read; a pickle disguised
  as ``model.safetensors`` fails in safetensors' parser; ``trust_pickle=True`` lifts exactly our
  refusal (what transformers / torch then do with the file is theirs).
* ``ConceptMoEVLMProcessor.from_pretrained``: JSON files replaced by pickles fail to parse, pickles
  next to them are ignored, tokenizer remote code (``auto_map``) is not run.
* the lmms-eval plugin: a path holding only a pickle is refused with one clear line.
* ``vlm.convert``: refuses a pickle-only folder (exit 2).
* trainer metadata (vlm/training/checkpoint.py, JSON): a pickle under ``trainer_state.json`` makes
  the folder incomplete; one under ``rank_00000.json`` fails to parse; ``*.pt`` extras are never
  opened by our code. DeepSpeed's own engine files (``*_model_states.pt``) are out of scope:
  resuming trusts the run directory.
* ``load_state_dict_checked``: a tied ``lm_head`` missing from the source is loaded through the
  embedding (not missing); an untied one is missing; a stray key is unexpected.
"""
import json
import os
import pickle
import types

import pytest
import torch

from vlm import ConceptMoEConfig, ConceptMoEForCausalLM
from vlm.convert import main as convert_main
from _ckpt import FakeEngine
from _ckpt import save as save_checkpoint
from vlm.modeling.safe_loading import (
    NotJSONError,
    UnsafeCheckpoint,
    load_state_dict_checked,
    read_json,
    require_safetensors,
)
from vlm.training import checkpoint as ck


class _Marker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):  # unpickling this would create the marker file
        return (open, (self.path, "w"))


def plant(path, marker, protocol=None) -> bytes:
    """Write a pickle that creates ``marker`` when unpickled; returns its bytes."""
    data = pickle.dumps({"x": _Marker(str(marker))}, protocol=protocol)
    with open(path, "wb") as f:
        f.write(data)
    return data


@pytest.fixture
def marker(tmp_path):
    return tmp_path / "EXECUTED"


def test_the_planted_pickle_really_runs(tmp_path, marker):
    """Sanity: the marker mechanism works, so 'no marker' below means 'never unpickled'."""
    data = plant(tmp_path / "x.pkl", marker)
    pickle.loads(data)  # noqa: S301 - the one deliberate unpickling, of our own planted bytes
    assert marker.exists()


@pytest.fixture
def pickle_only_checkpoint(tmp_path, marker):
    cfg = ConceptMoEConfig.from_yaml("configs/model/tiny.yaml", vocab_size=64)
    torch.manual_seed(0)
    ConceptMoEForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    os.remove(tmp_path / "ckpt" / "model.safetensors")
    plant(tmp_path / "ckpt" / "pytorch_model.bin", marker)
    return tmp_path / "ckpt", marker


def test_model_loader_refuses_pickles(pickle_only_checkpoint):
    from transformers import AutoModelForCausalLM
    ckpt, marker = pickle_only_checkpoint
    with pytest.raises(UnsafeCheckpoint, match="pickle"):
        ConceptMoEForCausalLM.from_pretrained(ckpt)
    with pytest.raises(UnsafeCheckpoint):
        AutoModelForCausalLM.from_pretrained(ckpt)
    with pytest.raises(UnsafeCheckpoint, match="is a pickle file"):  # the pickle file itself as the path
        ConceptMoEForCausalLM.from_pretrained(ckpt / "pytorch_model.bin")
    assert not marker.exists()


def test_convert_refuses_pickles(pickle_only_checkpoint, tmp_path):
    ckpt, marker = pickle_only_checkpoint
    assert convert_main(["--from", str(ckpt), "--to", str(tmp_path / "out")]) == 2  # one clear line
    assert not marker.exists()


def test_vlm_loader_refuses_pickles(tmp_path, marker):
    """A VLM folder with only config.json + a pickle: refused by the class and the Auto classes."""
    import transformers

    from vlm import ConceptMoEVLMConfig, ConceptMoEVLMForConditionalGeneration

    folder = tmp_path / "vlm"
    ConceptMoEVLMConfig.from_yaml("configs/model/vlm_tiny.yaml").save_pretrained(folder)
    plant(folder / "pytorch_model.bin", marker)
    with pytest.raises(UnsafeCheckpoint, match="only pickle weights"):
        ConceptMoEVLMForConditionalGeneration.from_pretrained(folder)
    autos = [transformers.AutoModel] + [getattr(transformers, n) for n in ("AutoModelForImageTextToText",)
                                        if hasattr(transformers, n)]
    for auto in autos:
        with pytest.raises(UnsafeCheckpoint):
            auto.from_pretrained(folder)
    assert not marker.exists()


def test_pickles_next_to_safetensors_are_never_read(tmp_path, marker):
    cfg = ConceptMoEConfig.from_yaml("configs/model/tiny.yaml", vocab_size=64)
    model = ConceptMoEForCausalLM(cfg)
    model.save_pretrained(tmp_path / "ckpt")
    for name in ("pytorch_model.bin", "training_args.bin", "optimizer.pt", "extra.pkl"):
        plant(tmp_path / "ckpt" / name, marker)
    loaded = ConceptMoEForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert not marker.exists()


def test_pickle_disguised_as_safetensors_is_not_unpickled(tmp_path, marker):
    cfg = ConceptMoEConfig.from_yaml("configs/model/tiny.yaml", vocab_size=64)
    ConceptMoEForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    plant(tmp_path / "ckpt" / "model.safetensors", marker)
    with pytest.raises(Exception) as info:  # safetensors' header parser refuses it
        ConceptMoEForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert not isinstance(info.value, UnsafeCheckpoint)
    assert convert_main(["--from", str(tmp_path / "ckpt"), "--to", str(tmp_path / "out")]) == 2  # one line
    assert not marker.exists()


def test_trust_pickle_lifts_exactly_our_refusal(pickle_only_checkpoint, monkeypatch):
    """trust_pickle=True: our check passes and use_safetensors is no longer forced. We stub the
    transformers loader underneath to observe precisely what our wrapper hands it."""
    from transformers import PreTrainedModel

    ckpt, marker = pickle_only_checkpoint
    require_safetensors(ckpt, trust_pickle=True)  # no exception
    require_safetensors(ckpt / "pytorch_model.bin", trust_pickle=True)
    calls = []

    def recorder(cls, path, *args, **kwargs):
        calls.append((cls, path, kwargs))
        # the wrapper asks for the loading report (a legacy expert layout is fused after loading)
        return ("loaded", {"missing_keys": [], "unexpected_keys": []}) if kwargs.get("output_loading_info") else "loaded"

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(recorder))
    with pytest.raises(UnsafeCheckpoint):
        ConceptMoEForCausalLM.from_pretrained(ckpt)
    assert calls == []  # refused before transformers was asked
    assert ConceptMoEForCausalLM.from_pretrained(ckpt, trust_pickle=True) == "loaded"
    (cls, path, kwargs), = calls
    assert cls is ConceptMoEForCausalLM and path == ckpt
    assert "use_safetensors" not in kwargs and "trust_pickle" not in kwargs
    monkeypatch.undo()
    # the real transformers call: whatever it decides, it is not our refusal
    try:
        ConceptMoEForCausalLM.from_pretrained(ckpt, trust_pickle=True)
    except Exception as err:  # noqa: BLE001 - e.g. torch's weights_only refusal
        assert not isinstance(err, UnsafeCheckpoint)
    # (no assertion on the marker here: trusting the file is the user's explicit choice)


# ----- processor ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory):
    from _data_helpers import tiny_tokenizer
    from vlm.modeling.processing_conceptmoe_vl import ConceptMoEVLMProcessor

    root = tmp_path_factory.mktemp("proc")
    processor = ConceptMoEVLMProcessor(tiny_tokenizer(str(root / "tok")), num_image_tokens=4, image_size=16)
    return processor.save_pretrained(str(root / "processor"))


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("name", ["processor_config.json", "tokenizer.json", "tokenizer_config.json",
                                  "special_tokens_map.json"])
@pytest.mark.parametrize("protocol", [0, pickle.HIGHEST_PROTOCOL])
def test_processor_files_replaced_by_pickles(processor_dir, tmp_path, marker, name, protocol):
    from vlm.modeling.processing_conceptmoe_vl import ConceptMoEVLMProcessor

    folder = _copy(processor_dir, tmp_path / "p")
    plant(folder / name, marker, protocol)
    with pytest.raises(Exception):  # a JSON / UTF-8 / tokenizers parse error
        ConceptMoEVLMProcessor.from_pretrained(str(folder))
    assert not marker.exists()


def test_processor_ignores_pickles_next_to_its_files(processor_dir, tmp_path, marker):
    from vlm.modeling.processing_conceptmoe_vl import ConceptMoEVLMProcessor

    folder = _copy(processor_dir, tmp_path / "p")
    for name in ("tokenizer.pkl", "processor.pkl", "preprocessor.bin", "training_args.bin", "vocab.pkl",
                 "image_processor.pt", "pytorch_model.bin"):
        plant(folder / name, marker)
    processor = ConceptMoEVLMProcessor.from_pretrained(str(folder))
    assert processor.num_image_tokens == 4
    assert not marker.exists()


def test_processor_does_not_run_tokenizer_remote_code(processor_dir, tmp_path, marker):
    from vlm.modeling.processing_conceptmoe_vl import ConceptMoEVLMProcessor

    folder = _copy(processor_dir, tmp_path / "p")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": [None, "evil_tok.EvilTokenizer"]})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "evil_tok.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                        "from transformers import PreTrainedTokenizerFast\n"
                                        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    with pytest.raises(ValueError, match="custom code"):
        ConceptMoEVLMProcessor.from_pretrained(str(folder))
    assert not marker.exists()


# ----- lmms-eval plugin -----------------------------------------------------------------------------
def _plugin(**kwargs):
    pytest.importorskip("lmms_eval")
    from eval_suites.lmms_plugin import ConceptMoEVLMEval

    return ConceptMoEVLMEval(device="cpu", **kwargs)


def test_lmms_plugin_refuses_a_pickle_only_path(tmp_path, marker):
    from vlm import ConceptMoEVLMConfig

    folder = tmp_path / "export"
    folder.mkdir()
    plant(folder / "pytorch_model.bin", marker)
    with pytest.raises(FileNotFoundError) as info:  # only a pickle: not an export
        _plugin(pretrained=str(folder))
    assert "no config.json" in str(info.value) and "\n" not in str(info.value)
    ConceptMoEVLMConfig.from_yaml("configs/model/vlm_tiny.yaml").save_pretrained(folder)
    with pytest.raises(FileNotFoundError) as info:  # a config + a pickle: still no safetensors weights
        _plugin(pretrained=str(folder))
    assert "no model.safetensors" in str(info.value) and "\n" not in str(info.value)
    stub = types.SimpleNamespace(to=lambda *a, **k: stub)  # an already built model object ...
    with pytest.raises(FileNotFoundError) as info:  # ... with a processor folder holding only pickles
        _plugin(pretrained=stub, processor=str(folder))
    assert "processor_config.json" in str(info.value) and "\n" not in str(info.value)
    assert not marker.exists()


# ----- trainer metadata -----------------------------------------------------------------------------
def _checkpoint(ckpt_dir):
    step = save_checkpoint(FakeEngine(), ckpt_dir, 1)  # DeepSpeed's engine files are out of scope: faked
    assert ck.find_checkpoint(ckpt_dir) == step
    return step


@pytest.mark.parametrize("protocol", [0, pickle.HIGHEST_PROTOCOL])
def test_pickle_as_trainer_state_makes_the_checkpoint_incomplete(tmp_path, marker, protocol):

    step = _checkpoint(tmp_path / "ckpt")
    plant(step / ck.TRAINER_STATE, marker, protocol)
    plant(step / "extra_state.pt", marker)
    assert not ck.is_complete(step)
    assert ck.find_checkpoint(tmp_path / "ckpt") is None and ck.list_checkpoints(tmp_path / "ckpt") == []
    assert ck.resolve_resume("auto", tmp_path / "ckpt") is None
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint") as info:
        ck.resolve_resume(str(step), tmp_path / "ckpt")
    assert "\n" not in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [0, pickle.HIGHEST_PROTOCOL])
def test_pickle_as_rank_state_is_not_unpickled(tmp_path, marker, protocol):

    step = _checkpoint(tmp_path / "ckpt")
    plant(step / ck.rank_file(0), marker, protocol)
    plant(step / "extra_state.pt", marker)
    assert ck.find_checkpoint(tmp_path / "ckpt") == step  # rank files are only checked to exist
    with pytest.raises(NotJSONError):
        ck.load(FakeEngine(), step, rank=0, world_size=1)
    assert not marker.exists()


def test_extra_pt_files_are_never_opened(tmp_path, marker):

    step = _checkpoint(tmp_path / "ckpt")
    for name in ("extra_state.pt", "rng.pth", "trainer_state.pt", "rank_00000.pkl"):
        plant(step / name, marker)
    engine = FakeEngine()
    trainer_state, rank_state = ck.load(engine, ck.find_checkpoint(tmp_path / "ckpt"), rank=0, world_size=1)
    assert trainer_state["step"] == 1 and rank_state["rank"] == 0 and engine.loaded == step
    assert not marker.exists()


def test_pickle_as_latest_pointer_falls_back_to_the_scan(tmp_path, marker):

    step = _checkpoint(tmp_path / "ckpt")
    plant(tmp_path / "ckpt" / ck.LATEST, marker)
    try:
        assert ck.find_checkpoint(tmp_path / "ckpt") == step
    finally:
        assert not marker.exists()


def test_pickle_as_rank_state_is_one_clear_line(tmp_path, marker):

    step = _checkpoint(tmp_path / "ckpt")
    plant(step / ck.rank_file(0), marker)
    with pytest.raises(ValueError) as info:
        ck.load(FakeEngine(), step, rank=0, world_size=1)
    assert ck.rank_file(0) in str(info.value) and "\n" not in str(info.value)
    assert not marker.exists()


# ----- read_json: our JSON metadata, never a pickle ---------------------------------------------------
@pytest.mark.parametrize("protocol", [0, pickle.HIGHEST_PROTOCOL])
def test_read_json_refuses_a_pickle_in_one_line(tmp_path, marker, protocol):
    path = tmp_path / "trainer_state.json"
    plant(path, marker, protocol)
    with pytest.raises(NotJSONError) as info:
        read_json(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    if protocol >= 2:
        assert "looks like a pickle" in str(info.value)
    path.write_text(json.dumps({"step": 3}))
    assert read_json(path) == {"step": 3}
    assert not marker.exists()


@pytest.mark.parametrize("tied", [True, False])
def test_state_dict_keys_accounted_for(tied):
    cfg = ConceptMoEConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, num_experts=2, num_experts_per_tok=1,
                           moe_intermediate_size=16, chunking=False, tie_word_embeddings=tied)
    src, dst = ConceptMoEForCausalLM(cfg), ConceptMoEForCausalLM(cfg)
    state = {k: v for k, v in src.state_dict().items() if k != "lm_head.weight"}
    missing, unexpected = load_state_dict_checked(dst, {**state, "model.stray.weight": torch.zeros(1)})
    assert missing == ([] if tied else ["lm_head.weight"]) and unexpected == ["model.stray.weight"]
    assert torch.equal(dst.lm_head.weight, src.model.embed_tokens.weight) == tied
