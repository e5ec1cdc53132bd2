"""vlm/modeling/modeling_conceptmoe.py: save/load through the Auto classes (safetensors only), losses, outputs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

import vlm
from vlm.modeling.configuration_conceptmoe import ConceptMoEConfig
from vlm.modeling.modeling_conceptmoe import ConceptMoEForCausalLM, lm_loss_fn

from _export import saved_equals_live
from conftest import PRESETS

V = 2048


def _randomise_extras(model):
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.attn.joint:
                for lin in (layer.attn.q_c_proj, layer.attn.k_c_proj, layer.attn.v_c_proj):
                    lin.weight.normal_(0.0, 0.05)
    return model


@pytest.mark.parametrize("preset, overrides", [("tiny", {}), ("tiny_concept", {}),
                                               ("tiny_concept", dict(concept_merge="sum", concept_hidden_size=32,
                                                                     tie_word_embeddings=True))])
def test_save_and_auto_load_identical(tmp_path, tiny_model, make_decisive, preset, overrides):
    model = tiny_model(preset, **overrides)
    if model.config.chunking:
        _randomise_extras(make_decisive(model, 4))
    model.save_pretrained(tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors" in files and "config.json" in files
    saved_equals_live(model, tmp_path, tied=("lm_head.weight",) if model.config.tie_word_embeddings else ())
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt"))], files
    assert isinstance(AutoConfig.from_pretrained(tmp_path), ConceptMoEConfig)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, ConceptMoEForCausalLM)
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:  # nothing re-initialised on load (router, joint projections, experts)
        assert torch.equal(sd[k], sd2[k]), k
    ids = torch.randint(1, V, (2, 14))
    am = torch.ones_like(ids)
    am[0, :5] = 0
    with torch.no_grad():
        a, b = model(ids, attention_mask=am), loaded(ids, attention_mask=am)
    assert torch.equal(a.logits, b.logits)
    if model.config.chunking:
        assert torch.equal(a.boundary_mask, b.boundary_mask)
    assert loaded.generation_config.top_k is None  # config.top_k is the MoE's, not a sampling knob


def test_load_plain_checkpoint_as_conceptmoe(tmp_path, tiny_model):
    """A plain MoE checkpoint loads into a ConceptMoE config: the missing chunker gets its identity
    init and the joint projections zeros, so with every token a concept the logits are unchanged."""
    plain = tiny_model("tiny", seed=3)
    plain.save_pretrained(tmp_path)
    cfg = ConceptMoEConfig.from_yaml(PRESETS / "tiny_concept.yaml", boundary_mode="all")
    concept = AutoModelForCausalLM.from_pretrained(tmp_path, config=cfg).eval()
    assert torch.equal(concept.model.chunker.q_proj.weight, torch.eye(64))
    for proj in ("q_c_proj", "k_c_proj", "v_c_proj"):
        w = getattr(concept.model.layers[3].attn, proj).weight
        assert torch.equal(w, torch.zeros_like(w)), proj
    ids = torch.randint(1, V, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(concept(ids).logits, plain(ids).logits, atol=1e-5, rtol=0)


def test_lm_loss_shift_and_ignore():
    logits = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    labels[1, :3] = -100
    keep = labels[:, 1:] != -100
    ref = F.cross_entropy(logits[:, :-1][keep], labels[:, 1:][keep])
    torch.testing.assert_close(lm_loss_fn(logits, labels), ref)
    assert lm_loss_fn(logits, torch.full_like(labels, -100)).item() == 0.0


@pytest.mark.parametrize("preset", ["tiny", "tiny_concept"])
def test_total_loss_composition(tiny_model, preset):
    model = tiny_model(preset, router_aux_loss_coef=0.1, router_z_loss_coef=0.01, ratio_loss_weight=0.5).train()
    ids = torch.randint(1, V, (2, 12))
    out = model(ids, labels=ids)
    want = out.lm_loss + 0.1 * out.lb_loss + 0.01 * out.z_loss
    if model.config.chunking:
        assert out.ratio_loss > 0 and out.compression["ratio"] >= 1.0
        want = want + 0.5 * out.ratio_loss
    else:
        assert out.ratio_loss.item() == 0.0 and out.compression is None and out.boundary_mask is None
    torch.testing.assert_close(out.loss, want)
    assert out.lb_loss > 0 and out.z_loss > 0
    assert len(out.tokens_per_expert) == 4 and int(out.tokens_per_expert[0].sum()) == 2 * 12 * 2
    assert model(ids).loss is None


def test_concept_outputs(tiny_model):
    model = tiny_model("tiny_concept").eval()
    ids = torch.randint(1, V, (2, 12))
    am = torch.ones_like(ids)
    am[1, :4] = 0
    with torch.no_grad():
        out = model(ids, attention_mask=am)
    assert out.logits.shape == (2, 12, V)
    assert out.boundary_mask.shape == (2, 12) and out.boundary_mask.dtype == torch.bool
    assert torch.equal(out.num_concepts, out.boundary_mask.sum(1))
    assert out.compression["ratio"] == pytest.approx(20 / float(out.num_concepts.sum()))


def _split_expert_stacks(folder) -> int:
    """Rewrite an export's ``*.w_gate_up`` as ``*.w_gate`` / ``*.w_up`` (the layout before the fused weight)."""
    from safetensors.torch import load_file, save_file
    path = folder / "model.safetensors"
    state = load_file(path)
    fused = [k for k in state if k.endswith(".w_gate_up")]
    for k in fused:
        gate, up = state.pop(k).chunk(2, -1)
        state[k[:-len("w_gate_up")] + "w_gate"], state[k[:-len("w_gate_up")] + "w_up"] = gate.contiguous(), up.contiguous()
    save_file(state, path, metadata={"format": "pt"})
    return len(fused)


def test_an_export_with_separate_gate_and_up_loads_fused(tmp_path, tiny_model, caplog):
    """An export written before the fused expert weight (``w_gate`` / ``w_up`` in the safetensors) loads
    through ``from_pretrained`` and the Auto class with every expert stack exact, reports no missing or
    unexpected key, and says so in one line."""
    model = tiny_model("tiny_concept")
    model.save_pretrained(tmp_path)
    n = _split_expert_stacks(tmp_path)
    assert n == sum(1 for k in model.state_dict() if k.endswith(".w_gate_up")) > 0
    with caplog.at_level("WARNING", logger="vlm.modeling.legacy_experts"):
        got, info = ConceptMoEForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert [r.getMessage().count("\n") for r in caplog.records if "w_gate / w_up" in r.getMessage()] == [0]
    for k, v in model.state_dict().items():
        assert torch.equal(got.state_dict()[k], v), k
    auto = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(1, V, (1, 9))
    torch.testing.assert_close(auto(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_vlm_export_with_separate_gate_and_up_loads_fused(tmp_path):
    """The same for a VLM export (keys under ``language_model.model.layers.*.ffn``)."""
    from test_vlm_model import build

    from vlm.modeling.modeling_conceptmoe_vl import ConceptMoEVLMForConditionalGeneration as VLM

    model = build()
    model.save_pretrained(tmp_path)
    assert _split_expert_stacks(tmp_path) > 0
    got, info = VLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for k, v in model.state_dict().items():
        assert torch.equal(got.state_dict()[k], v), k


def test_public_names_of_the_package():
    """``vlm.X`` is the model package's class (loaded on first use), ``__all__`` lists what resolves, and a
    name we do not export is an AttributeError, as for any module."""
    from vlm.modeling import configuration_conceptmoe_vl, modeling_conceptmoe_vl, processing_conceptmoe_vl

    assert vlm.ConceptMoEVLMConfig is configuration_conceptmoe_vl.ConceptMoEVLMConfig
    assert vlm.ConceptMoEVLMForConditionalGeneration is modeling_conceptmoe_vl.ConceptMoEVLMForConditionalGeneration
    assert vlm.ConceptMoEVLMProcessor is processing_conceptmoe_vl.ConceptMoEVLMProcessor
    assert vlm.ConceptMoEForCausalLM is ConceptMoEForCausalLM and vlm.ConceptMoEConfig is ConceptMoEConfig
    assert {name for name in vlm.__all__ if getattr(vlm, name) is not None} == set(vlm.__all__)
    assert set(vlm.__all__) <= set(dir(vlm))
    assert set(vlm.__all__) == {*vlm._PUBLIC, "register_auto_classes"}
    with pytest.raises(AttributeError, match="no attribute 'ConceptMoEModel'"):
        vlm.ConceptMoEModel  # noqa: B018


AUTO_CHECK = """
import sys
import vlm
assert not {"torch", "transformers"} & set(sys.modules), "import vlm loaded torch or transformers"
from vlm import ConfigError
assert not {"torch", "transformers"} & set(sys.modules), "vlm.ConfigError loaded torch or transformers"
vlm.register_auto_classes()
from transformers import (AutoConfig, AutoImageProcessor, AutoModel, AutoModelForCausalLM,
                          AutoModelForImageTextToText, AutoProcessor)
from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING
lm, vl = AutoConfig.for_model("conceptmoe"), AutoConfig.for_model("conceptmoe_vlm")
assert type(lm).__name__ == "ConceptMoEConfig" and type(vl).__name__ == "ConceptMoEVLMConfig"
assert AutoModelForCausalLM._model_mapping[type(lm)].__name__ == "ConceptMoEForCausalLM"
for auto in (AutoModel, AutoModelForImageTextToText):
    assert auto._model_mapping[type(vl)].__name__ == "ConceptMoEVLMForConditionalGeneration"
assert PROCESSOR_MAPPING[type(vl)].__name__ == "ConceptMoEVLMProcessor"
assert "ConceptMoEImageProcessor" in repr(IMAGE_PROCESSOR_MAPPING[type(vl)])
print("ok")
"""


@pytest.mark.integration  # a fresh interpreter: the registration is only unseen there
def test_import_vlm_is_light_and_register_auto_classes_registers():
    """``import vlm`` (and ``vlm.ConfigError``) loads neither torch nor transformers (the command lines'
    errors and --help come at once); ``vlm.register_auto_classes()`` registers the config, both models,
    the processor and the image processor with the Auto classes (the conftest does it for this session)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run([sys.executable, "-c", AUTO_CHECK], cwd=root, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
