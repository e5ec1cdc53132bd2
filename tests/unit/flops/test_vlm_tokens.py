"""vlm.flops.vlm_tokens: LLM FLOPs per VLM sample, plain (tokens x per-token FLOPs) and chunked (at the
pooled ratio of the per-modality targets)."""
import pytest

from vlm.flops import flops_per_token, llm_flops_per_sample
from vlm.flops.vlm_tokens import pooled_ratio
from vlm.modeling.configuration_conceptmoe import ConceptMoEConfig

BASE = {"num_hidden_layers": 4, "attention": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2},
        "moe": {"num_experts": 8, "top_k": 2, "moe_intermediate_size": 16}, "vocab_size": 256}


def test_plain_moe_is_tokens_times_per_token():
    cfg = ConceptMoEConfig.from_dict_sections({**BASE, "chunking": {"enabled": False}})
    f = llm_flops_per_sample(cfg, 16, 20, seq_len=128)
    assert f["tokens"] == 36 and f["ratio"] == 1.0
    assert f["forward"] == 36 * flops_per_token(cfg, 128)["total_no_attn_map"]
    assert f["train"] == 3 * f["forward"]


def test_chunked_uses_the_pooled_per_modality_ratio():
    cfg = ConceptMoEConfig.from_dict_sections({**BASE, "chunking": {
        "enabled": True, "encoder_layers": 1, "decoder_layers": 1, "image_target_ratio": 4.0, "text_target_ratio": 2.0}})
    f = llm_flops_per_sample(cfg, 64, 20, seq_len=128)
    assert f["ratio"] == pytest.approx(84 / (64 / 4 + 20 / 2))
    assert f["forward"] == pytest.approx(84 * flops_per_token(cfg, 128, ratio=f["ratio"])["total_no_attn_map"])
    g = llm_flops_per_sample(cfg, 64, 20, seq_len=128, image_ratio=2.0, text_ratio=2.0)  # measured ratios
    assert g["ratio"] == pytest.approx(2.0) and g["forward"] > f["forward"]
    assert pooled_ratio(10, 0, 5.0, 1.0) == pytest.approx(5.0)
