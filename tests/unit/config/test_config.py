"""vlm/modeling/configuration_conceptmoe.py: presets, sectioned/dotted overrides, one-line ConfigErrors naming the key."""
from __future__ import annotations

import pytest
import yaml

from vlm.modeling.configuration_conceptmoe import FIELD_OWNER, ConceptMoEConfig
from vlm.modeling.config_base import ConfigError

from conftest import PRESETS

TINY, TINY_CONCEPT = PRESETS / "tiny.yaml", PRESETS / "tiny_concept.yaml"


def _raises_one_line(key: str, fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert key in msg, f"{key!r} not named in {msg!r}"
    return msg


def test_presets_load_with_their_values():
    plain = ConceptMoEConfig.from_yaml(TINY)
    con = ConceptMoEConfig.from_yaml(TINY_CONCEPT)
    assert not plain.chunking and con.chunking
    assert (plain.hidden_size, plain.num_attention_heads, plain.num_key_value_heads) == (64, 4, 2)
    assert (plain.num_experts, plain.top_k, plain.moe_intermediate_size) == (8, 2, 128)
    assert plain.max_position_embeddings == 2048 and plain.vocab_size == 2048
    assert (con.encoder_layers, con.decoder_layers, con.concept_layers) == (1, 1, 2)
    assert con.target_ratio == 2.0 and con.concept_merge == "last" and con.joint_decoding_layers == 1
    assert plain.concept_layers == 0
    # component views carry the same values
    assert con.moe.num_experts == 8 and con.attention.hidden_size == 64 and con.chunk.target_ratio == 2.0


def test_from_yaml_overrides_flat_and_dotted():
    cfg = ConceptMoEConfig.from_yaml(TINY, num_experts=16, top_k=4)
    assert (cfg.num_experts, cfg.top_k) == (16, 4)
    cfg = ConceptMoEConfig.from_dict_sections(yaml.safe_load(TINY.read_text()), {"moe.num_experts": 16})
    assert cfg.num_experts == 16
    cfg = ConceptMoEConfig.from_dict_sections(yaml.safe_load(TINY.read_text()),
                                              {"chunking.enabled": True, "chunking.modality_policy": "split_at_switch"})
    assert cfg.chunking and cfg.modality_policy == "split_at_switch"
    cfg = ConceptMoEConfig.from_yaml(TINY_CONCEPT, **{"chunking.concept_merge": "sum"})
    assert cfg.concept_merge == "sum"


def test_model_wrapped_yaml(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"model": yaml.safe_load(TINY_CONCEPT.read_text())}))
    assert ConceptMoEConfig.from_yaml(path).chunking


@pytest.mark.parametrize("preset, overrides, key", [
    (TINY, {"top_k": 9}, "top_k"),
    (TINY, {"moe.top_k": 0}, "top_k"),
    (TINY, {"num_experts": 0}, "num_experts"),
    (TINY_CONCEPT, {"target_ratio": 0.5}, "target_ratio"),
    (TINY, {"hidden_size": 66}, "hidden_size"),
    (TINY, {"num_key_value_heads": 3}, "num_key_value_heads"),
    (TINY, {"bogus_key": 1}, "bogus_key"),
    (TINY, {"moe.bogus_key": 1}, "moe.bogus_key"),
    (TINY, {"bogus.num_experts": 16}, "bogus.num_experts"),
    (TINY, {"a.b.top_k": 1}, "a.b.top_k"),
    (TINY_CONCEPT, {"concept_merge": "mean"}, "concept_merge"),
    (TINY, {"concept_merge": "mean"}, "concept_merge"),  # checked even with chunking off
    (TINY_CONCEPT, {"modality_policy": "split"}, "modality_policy"),
    (TINY, {"chunking.modality_policy": "split"}, "modality_policy"),
    (TINY_CONCEPT, {"boundary_mode": "random"}, "boundary_mode"),
    (TINY_CONCEPT, {"router_init": "zeros"}, "router_init"),
    (TINY_CONCEPT, {"boundary_noise_tau": -1.0}, "boundary_noise_tau"),
    (TINY_CONCEPT, {"ratio_loss_weight": -0.1}, "ratio_loss_weight"),
    (TINY_CONCEPT, {"image_target_ratio": 2.0}, "image_target_ratio"),
    (TINY_CONCEPT, {"image_target_ratio": 0.5, "text_target_ratio": 2.0}, "image_target_ratio"),
    (TINY_CONCEPT, {"encoder_layers": 2, "decoder_layers": 2}, "num_hidden_layers"),
    (TINY_CONCEPT, {"decoder_layers": 0}, "decoder_layers"),
    (TINY_CONCEPT, {"concept_top_k": 9}, "concept_top_k"),
    (TINY_CONCEPT, {"concept_loop_layers": [2]}, "concept_loop_layers"),
    (TINY_CONCEPT, {"concept_loop_times": 0}, "concept_loop_times"),
    (TINY_CONCEPT, {"concept_hidden_size": 30}, "concept_hidden_size"),
    (TINY_CONCEPT, {"joint_decoding_layers": -1}, "joint_decoding_layers"),
    (TINY, {"moe_dispatch": "fast"}, "moe_dispatch"),
    (TINY, {"vocab_size": 0}, "vocab_size"),
    (TINY, {"max_position_embeddings": 0}, "max_position_embeddings"),
])
def test_bad_values_one_line_error(preset, overrides, key):
    _raises_one_line(key, ConceptMoEConfig.from_yaml, preset, **overrides)


def test_unknown_key_in_yaml(tmp_path):
    raw = yaml.safe_load(TINY.read_text())
    raw["moe"]["num_expert"] = 4
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    _raises_one_line("moe.num_expert", ConceptMoEConfig.from_yaml, path)
    raw = yaml.safe_load(TINY.read_text())
    raw["hiden_size"] = 4
    path.write_text(yaml.safe_dump(raw))
    _raises_one_line("hiden_size", ConceptMoEConfig.from_yaml, path)


def test_bad_files(tmp_path):
    _raises_one_line("not found", ConceptMoEConfig.from_yaml, tmp_path / "missing.yaml")
    path = tmp_path / "broken.yaml"
    path.write_text("a: [1, 2\nb: {")
    _raises_one_line("broken.yaml", ConceptMoEConfig.from_yaml, path)
    path.write_text("- 1\n- 2\n")
    _raises_one_line("mapping", ConceptMoEConfig.from_yaml, path)


def test_nullable_fields_accept_null():
    cfg = ConceptMoEConfig.from_yaml(TINY_CONCEPT, boundary_noise_tau=None, concept_hidden_size=None,
                                     head_dim=None, concept_top_k=None)
    assert cfg.boundary_noise_tau is None and cfg.resolved_head_dim == 16


def test_hf_roundtrip(tmp_path):
    cfg = ConceptMoEConfig.from_yaml(TINY_CONCEPT, concept_loop_layers=[1], concept_loop_times=2,
                                     concept_hidden_size=32)
    cfg.save_pretrained(tmp_path)
    back = ConceptMoEConfig.from_pretrained(tmp_path)
    for name in FIELD_OWNER:
        assert getattr(back, name) == getattr(cfg, name), name


@pytest.mark.parametrize("over, key", [({"hidden_size": 60, "num_attention_heads": 4}, "hidden_size"),
                                       ({"head_dim": 15}, "head_dim"),
                                       ({"chunking.enabled": True, "concept_hidden_size": 100}, "concept_hidden_size")])
def test_odd_head_dimension_is_a_clear_error(over, key):
    with pytest.raises(ConfigError) as err:
        ConceptMoEConfig.from_yaml(PRESETS / "tiny_concept.yaml", **over)
    assert key in str(err.value) and "even" in str(err.value) and "\n" not in str(err.value)
