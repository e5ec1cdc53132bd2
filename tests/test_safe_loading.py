"""Loading never unpickles: a folder with only a pickle is refused and the pickle never runs."""
import os
import pickle

import pytest
import torch

from vlm import ConceptMoEConfig, ConceptMoEForCausalLM
from vlm.convert import main as convert_main
from vlm.safe_loading import UnsafeCheckpoint


class _Marker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):  # unpickling this would create the marker file
        return (open, (self.path, "w"))


@pytest.fixture
def pickle_only_checkpoint(tmp_path):
    cfg = ConceptMoEConfig.from_yaml("configs/model/tiny.yaml", vocab_size=64)
    torch.manual_seed(0)
    ConceptMoEForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    os.remove(tmp_path / "ckpt" / "model.safetensors")
    marker = tmp_path / "EXECUTED"
    with open(tmp_path / "ckpt" / "pytorch_model.bin", "wb") as f:
        pickle.dump({"x": _Marker(str(marker))}, f)
    return tmp_path / "ckpt", marker


def test_model_loader_refuses_pickles(pickle_only_checkpoint):
    from transformers import AutoModelForCausalLM
    ckpt, marker = pickle_only_checkpoint
    with pytest.raises(UnsafeCheckpoint, match="pickle"):
        ConceptMoEForCausalLM.from_pretrained(ckpt)
    with pytest.raises(UnsafeCheckpoint):
        AutoModelForCausalLM.from_pretrained(ckpt)
    assert not marker.exists()


def test_convert_refuses_pickles(pickle_only_checkpoint, tmp_path):
    ckpt, marker = pickle_only_checkpoint
    assert convert_main(["--from", str(ckpt), "--to", str(tmp_path / "out")]) == 2  # one clear line
    assert not marker.exists()
