"""The FLOPs / params / KV accountant (vlm/flops/accountant.py) and the matching solver (vlm/flops/matching.py).

Ground truth: ``sum(p.numel())`` of the real model (meta device) for parameters, FlopCounterMode
on a real CPU forward pass (batch 1, no padding, eval mode, the measured number of concepts) for
FLOPs, and the bytes a real ``DecodeState`` holds after prefill for the KV cache.

FlopCounterMode on CPU has no formula for ``_scaled_dot_product_flash_attention_for_cpu`` (it
counts 0 for SDPA); the tests register torch's own SDPA formula for it (full N x N, as on CUDA).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from vlm.modeling.configuration_conceptmoe import ConceptMoEConfig
from vlm.flops.matching import config_to_sections, solve_match, write_yaml
from vlm.flops import Arch, compare_table, count_params, flops_per_token, kv_bytes_per_token
from vlm.flops.__main__ import main
from vlm.modeling.modeling_conceptmoe import ConceptMoEForCausalLM

PRESETS = Path(__file__).resolve().parents[3] / "configs" / "model"
SDPA_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

# every structural option of the model, on tiny sizes
CASES = {
    "plain": ("tiny", {}),
    "plain_dense_shared_tied": ("tiny", {"first_k_dense": 1, "shared_expert_intermediate_size": 32,
                                         "tie_word_embeddings": True}),
    "concept_last": ("tiny_concept", {}),
    "concept_sum_wide": ("tiny_concept", {"concept_merge": "sum", "concept_hidden_size": 96, "concept_top_k": 3}),
    "concept_loop": ("tiny_concept", {"num_hidden_layers": 6, "concept_loop_layers": [1, 2],
                                      "concept_loop_times": 3, "concept_top_k": 4}),
    "concept_joint_k2": ("tiny_concept", {"num_hidden_layers": 6, "decoder_layers": 2, "joint_decoding_layers": 4}),
    "concept_everything": ("tiny_concept", {
        "num_hidden_layers": 6, "decoder_layers": 2, "joint_decoding_layers": 2, "concept_merge": "sum",
        "concept_hidden_size": 96, "head_dim": 32, "concept_loop_layers": [0], "concept_loop_times": 2,
        "first_k_dense": 2, "shared_expert_intermediate_size": 32, "tie_word_embeddings": True,
        "concept_top_k": 3}),
}


def _cfg(name: str) -> ConceptMoEConfig:
    preset, over = CASES[name]
    return ConceptMoEConfig.from_yaml(PRESETS / f"{preset}.yaml", **over)


def _meta_numel(cfg) -> int:
    with torch.device("meta"):
        model = ConceptMoEForCausalLM(cfg)
    return sum(p.numel() for p in model.parameters())


def _sdpa_formula(q, k, v, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(q, k, v)


@pytest.mark.parametrize("name", list(CASES))
def test_total_params_equal_model_numel(name):
    cfg = _cfg(name)
    assert count_params(cfg)["total"] == _meta_numel(cfg)


@pytest.mark.parametrize("preset", ["small", "small_concept", "small_concept_loop", "small_concept_wide",
                                    "moe_a05b_12b", "concept_a05b_12b", "bench_moe_top8", "bench_1l_top24_r2",
                                    "bench_2l_top7_r2"])
def test_presets_instantiate_on_meta_with_counted_params(preset):
    cfg = ConceptMoEConfig.from_yaml(PRESETS / f"{preset}.yaml")
    assert count_params(cfg)["total"] == _meta_numel(cfg)


def test_gpu_preset_sizes():
    p = count_params(ConceptMoEConfig.from_yaml(PRESETS / "moe_a05b_12b.yaml"))
    assert 11.5e9 < p["total"] < 13e9 and 0.45e9 < p["activated"] < 0.55e9
    small = count_params(ConceptMoEConfig.from_yaml(PRESETS / "small.yaml"))["total"]
    assert 40e6 < small < 60e6


def test_activated_params_plain_and_loop_weighting():
    cfg = _cfg("plain")
    p = count_params(cfg)
    inactive = cfg.num_hidden_layers * (cfg.num_experts - cfg.top_k) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert p["activated"] == p["total"] - p["embedding"] - inactive
    # a looped concept layer counts once per run, each run / R
    base = _cfg("concept_loop")
    unlooped = ConceptMoEConfig.from_yaml(PRESETS / "tiny_concept.yaml", num_hidden_layers=6, concept_top_k=4)
    a = Arch.of(base)
    d, I = a.d, a.inter
    layer = 2 * d + 2 * d * a.heads * a.hd(d) + 2 * d * a.kv * a.hd(d) + d * a.E + 3 * a.k_c * d * I
    extra = count_params(base)["activated"] - count_params(unlooped)["activated"]
    assert extra == pytest.approx(len(a.loop_layers) * (a.loop_times - 1) * layer / a.R)


@pytest.mark.parametrize("name,seq", [("plain", 96), ("plain_dense_shared_tied", 64), ("concept_last", 96),
                                      ("concept_loop", 64), ("concept_everything", 80)])
def test_flops_match_flop_counter(name, seq):
    cfg = _cfg(name)
    torch.manual_seed(0)
    model = ConceptMoEForCausalLM(cfg).float().eval()
    ids = torch.randint(0, cfg.vocab_size, (1, seq))
    with FlopCounterMode(display=False, custom_mapping={SDPA_CPU: _sdpa_formula}) as fc, torch.no_grad():
        out = model(ids)
    counts = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
    attn = counts.get(str(SDPA_CPU), 0)
    ratio = None
    if cfg.chunking:
        m = int(out.num_concepts[0])
        assert 1 <= m <= seq
        ratio = seq / m
    f = flops_per_token(cfg, seq, ratio=ratio)
    measured = fc.get_total_flops()
    assert f["total"] * seq == pytest.approx(measured, rel=0.02)
    assert f["total_no_attn_map"] * seq == pytest.approx(measured - attn, rel=0.02)
    assert f["attn_map"] * seq == pytest.approx(attn, rel=0.02)
    assert f["train_total"] == 3 * f["total"]


def test_causal_half_and_concept_attention_scaling():
    cfg = _cfg("concept_last")
    full, half = flops_per_token(cfg, 1024), flops_per_token(cfg, 1024, causal_half=True)
    assert half["attn_map"] == pytest.approx(full["attn_map"] / 2)
    a = Arch.of(cfg)
    tok = 4 * 1024 * a.heads * a.hd(a.d)
    # token layers at full length, concept layers over N / R concepts: / R^2 per token
    assert full["attn_map"] == pytest.approx((a.n_enc + a.n_dec) * tok + a.n_con * tok / a.R ** 2)
    assert flops_per_token(cfg, 1024, ratio=4)["attn_map"] < full["attn_map"]


@pytest.mark.parametrize("name", ["concept_last", "concept_loop", "plain"])
def test_kv_bytes_match_decode_state(name):
    cfg = _cfg(name)
    torch.manual_seed(0)
    model = ConceptMoEForCausalLM(cfg).float().eval()
    seq = 48
    ids = torch.randint(0, cfg.vocab_size, (1, seq))
    state = model.start_decoding(1, seq + 4)
    with torch.no_grad():
        model.prefill(state, ids)
    held = sum(c.nbytes() for c in state.token_caches + state.concept_caches)
    ratio = None
    if cfg.chunking:
        ratio = seq / int(model._last_prefill.num_concepts_B[0])
    kv = kv_bytes_per_token(cfg, ratio=ratio, dtype_bytes=4)
    assert kv["total"] * seq == pytest.approx(held)
    assert kv["total"] == pytest.approx(kv["encoder"] + kv["concept"] + kv["decoder"])


def test_kv_follows_the_paper_formulas():
    base = ConceptMoEConfig.from_yaml(PRESETS / "small.yaml")
    per_layer = kv_bytes_per_token(base)["total"] / base.num_hidden_layers
    topk = ConceptMoEConfig.from_yaml(PRESETS / "small_concept.yaml")
    loop = ConceptMoEConfig.from_yaml(PRESETS / "small_concept_loop.yaml")
    L_C = topk.concept_layers
    assert kv_bytes_per_token(topk)["concept"] == pytest.approx(L_C * per_layer / 2)
    runs = L_C + len(loop.concept_loop_layers) * (loop.concept_loop_times - 1)
    assert kv_bytes_per_token(loop)["concept"] == pytest.approx(runs * per_layer / 2)
    assert kv_bytes_per_token(topk, dtype_bytes=1)["total"] == kv_bytes_per_token(topk)["total"] / 2


def _errs(base, new, seq_len=4096):
    pb, pn = count_params(base)["total"], count_params(new)["total"]
    fb = flops_per_token(base, seq_len)["total_no_attn_map"]
    fn = flops_per_token(new, seq_len)["total_no_attn_map"]
    return abs(pn / pb - 1), abs(fn / fb - 1)


@pytest.mark.parametrize("strategy", ["topk", "loop", "wide"])
def test_solver_matches_small(strategy, tmp_path):
    base = ConceptMoEConfig.from_yaml(PRESETS / "small.yaml")
    new = solve_match(base, strategy, 2.0)
    p_err, f_err = _errs(base, new)
    assert p_err <= 0.01 and f_err <= 0.03, (p_err, f_err)
    assert new.chunking and new.target_ratio == 2.0
    assert new.encoder_layers == new.decoder_layers == 1
    assert new.moe_intermediate_size == base.moe_intermediate_size  # expert width never changes
    if strategy == "topk":
        assert new.num_experts == base.num_experts and new.concept_top_k > base.top_k
        assert not new.concept_loop_layers and new.concept_hidden_size is None
    elif strategy == "loop":
        assert new.concept_loop_layers and new.concept_loop_times == 2 and new.concept_hidden_size is None
        topk = solve_match(base, "topk", 2.0)
        if (new.num_experts, new.joint_decoding_layers) == (topk.num_experts, topk.joint_decoding_layers):
            assert count_params(new)["total"] == count_params(topk)["total"]  # looping adds no parameters
    else:
        assert new.concept_hidden_size > base.hidden_size and new.num_experts < base.num_experts
        assert new.concept_hidden_size % base.num_attention_heads == 0
    path = tmp_path / f"{strategy}.yaml"
    write_yaml(new, path, header=f"solved {strategy}")
    back = ConceptMoEConfig.from_yaml(path)
    assert path.read_text().startswith("# solved")
    assert config_to_sections(back) == config_to_sections(new)
    assert count_params(back)["total"] == count_params(new)["total"]


def test_solver_at_scale_keeps_paper_split():
    base = ConceptMoEConfig.from_yaml(PRESETS / "moe_a05b_12b.yaml")
    new = solve_match(base, "loop", 2.0)
    assert (new.encoder_layers, new.decoder_layers, new.joint_decoding_layers) == (4, 4, 4)
    p_err, f_err = _errs(base, new)
    assert p_err <= 0.01 and f_err <= 0.03
    with pytest.raises(ValueError):
        solve_match(new, "topk", 2.0)  # the baseline must be a plain MoE


@pytest.mark.parametrize("base,new", [("small", "small_concept"), ("small", "small_concept_loop"),
                                      ("small", "small_concept_wide"), ("moe_a05b_12b", "concept_a05b_12b"),
                                      ("bench_moe_top8", "bench_1l_top24_r2"), ("bench_moe_top8", "bench_2l_top7_r2")])
def test_matched_presets(base, new):
    b = ConceptMoEConfig.from_yaml(PRESETS / f"{base}.yaml")
    n = ConceptMoEConfig.from_yaml(PRESETS / f"{new}.yaml")
    p_err, f_err = _errs(b, n)
    assert p_err <= 0.01 and f_err <= 0.03, (p_err, f_err)
    if new == "concept_a05b_12b":
        assert n.encoder_layers == n.decoder_layers == 4
    if new == "bench_1l_top24_r2":
        assert n.concept_top_k == 24 and not n.concept_loop_layers


def test_compare_table_and_cli(capsys, tmp_path):
    a = ConceptMoEConfig.from_yaml(PRESETS / "small.yaml")
    b = ConceptMoEConfig.from_yaml(PRESETS / "small_concept.yaml")
    table = compare_table(a, b, 4096, 2.0)
    assert "| total params |" in table and "rel. diff" in table
    assert main(["--config", str(PRESETS / "small.yaml"), "--match-to", str(PRESETS / "small_concept.yaml"),
                 "--seq-len", "2048"]) == 0
    assert "attn-map FLOPs/token @2048" in capsys.readouterr().out
    assert main(["--config", str(PRESETS / "small_concept.yaml"), "--ratio", "2.2"]) == 0
    out = capsys.readouterr().out
    assert "R used: 2.2" in out and "chunk" in out
    dest = tmp_path / "solved.yaml"
    assert main(["--config", str(PRESETS / "small.yaml"), "--solve", "topk", "--ratio", "2", "--out", str(dest)]) == 0
    assert math.isclose(ConceptMoEConfig.from_yaml(dest).target_ratio, 2.0)


def test_written_preset_keeps_every_non_default_field(tmp_path):
    """write_yaml's layout comes from the config sections, so imported-model features survive a preset."""
    cfg = ConceptMoEConfig.from_yaml(PRESETS / "tiny.yaml", qkv_bias=True, o_proj_bias=True, qk_norm="head",
                                     shared_expert_intermediate_size=32, shared_expert_gate=True,
                                     rope_scaling_params={"rope_type": "linear", "factor": 2.0})
    path = tmp_path / "imported.yaml"
    write_yaml(cfg, path, header="imported")
    back = ConceptMoEConfig.from_yaml(path)
    for name in ConceptMoEConfig.known_keys():
        assert getattr(back, name) == getattr(cfg, name), name
