"""Mistral and Mixtral checkpoint folders with their SentencePiece tokenizer, as a user brings them:
through ``model.llm`` (the trainer's pretrained start), ``vlm.convert`` and the processor of the
resulting VLM. transformers routes these model types' tokenizers through mistral-common whenever
that package is installed, so what the environment holds decides whether they load at all."""
from __future__ import annotations

import importlib
import json

import pytest
import sentencepiece as spm
import torch
import transformers as T
from PIL import Image

from _sentencepiece import mistral_family_folder
from test_pretrained_start import _stand_ins
from vlm.config.train import REPO_ROOT, load_train_config
from vlm.training.build import build_processor, setup_model

FAMILIES = ("mistral", "mixtral")
TEXT = "What digit is this? It is 7.\nNew line, Ünïcödé"


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    out = tmp_path_factory.mktemp("mistral_family")
    for family in FAMILIES:
        mistral_family_folder(out / family, family)
    _stand_ins().save_vit(out / "vit", "siglip")
    return out


def test_installed_mistral_common_is_complete():
    """transformers imports mistral-common for every Mistral-family tokenizer once it is installed: it
    must then import with its dependencies (or not be installed, as `make setup` leaves it)."""
    from transformers.utils.import_utils import is_mistral_common_available

    if is_mistral_common_available():
        try:
            importlib.import_module("transformers.integrations.mistral.tokenizer")
        except ImportError as err:
            pytest.fail(f"mistral-common is installed but does not import ({err}): "
                        "`.venv/bin/pip uninstall -y mistral-common` (make setup does not install it)")


def _sentencepiece(folder) -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))


@pytest.mark.parametrize("family", FAMILIES)
def test_folder_as_model_llm_and_its_processor(parts, tmp_path, family):
    folder = parts / family
    raw = {"name": family, "output_dir": str(tmp_path), "data": {"kind": "synthetic"},
           "model": {"kind": "vlm", "preset": str(REPO_ROOT / "configs/model/llava.yaml"), "tokenizer": None,
                     "llm": str(folder), "vision": {"model_name": str(parts / "vit"), "image_aspect": "resize"}}}
    lines = []
    setup = setup_model(load_train_config(None, raw=raw), lines.append)
    model, tokenizer = setup.model.eval(), setup.tokenizer
    assert any(line.startswith(f"[model] language model <- {folder} ({family} checkpoint, imported)")
               for line in lines), lines
    assert tokenizer(TEXT, add_special_tokens=False)["input_ids"] == _sentencepiece(folder).encode(TEXT)
    n = _sentencepiece(folder).get_piece_size()
    assert tokenizer.convert_tokens_to_ids(["<image>", "<im_start>", "<im_end>"]) == [n, n + 1, n + 2]
    # the LLM's own weights and chat format: generation stops at its eos (the template's end of reply)
    ref = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert torch.equal(model.language_model.model.embed_tokens.weight[:n], ref.model.embed_tokens.weight)
    assert model.config.text_config.eos_token_id == tokenizer.eos_token_id == 2

    processor = build_processor(model, tokenizer)
    export = tmp_path / "export"
    model.save_pretrained(export)
    processor.save_pretrained(export)
    loaded = T.AutoProcessor.from_pretrained(export)
    image = Image.new("RGB", (16, 16), (200, 10, 10))
    batch = loaded(text=["<image>\nWhat digit is this?"], images=[image])
    prompt = loaded.decode(batch["input_ids"][0], skip_special_tokens=False)
    assert prompt.startswith("<s>[INST] <im_start>") and prompt.endswith("What digit is this? [/INST]"), prompt
    assert int((batch["input_ids"] == model.config.image_token_id).sum()) == model.num_image_tokens
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, batch["input_ids"].shape[1] + 3)


@pytest.mark.parametrize("family", FAMILIES)
def test_folder_through_convert(parts, tmp_path, family, capsys):
    from vlm import ConceptMoEForCausalLM
    from vlm.convert import main as convert
    from vlm.hf_import.check import logit_gap

    folder = parts / family
    assert convert(["--from", str(folder), "--to", str(tmp_path / "out")]) == 0
    assert "imported" in capsys.readouterr().out
    ours = ConceptMoEForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    ref = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert logit_gap(ours, ref, ref.config.vocab_size) <= 1e-4
    tokenizer = T.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer(TEXT, add_special_tokens=False)["input_ids"] == _sentencepiece(folder).encode(TEXT)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "conceptmoe"
