"""The expert-parallel communication and memory accountant (vlm/flops/comm.py): hand-computed bytes
for the tiny presets, the (ep - 1) / ep and 1 / R scalings, the concept layers' own top-k, width and
loop runs, the memory of ZeRO-1/2 with and without EP, and the CLI's ``--ep`` table."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vlm.modeling.configuration_conceptmoe import ConceptMoEConfig
from vlm.flops import count_params
from vlm.flops.__main__ import main
from vlm.flops.comm import a2a_bytes_per_step, expert_memory_per_gpu, expert_params, zero3_gather_bytes

PRESETS = Path(__file__).resolve().parents[3] / "configs" / "model"


def _cfg(name: str, **over) -> ConceptMoEConfig:
    return ConceptMoEConfig.from_yaml(PRESETS / f"{name}.yaml", **over)


def test_plain_moe_by_hand():
    # tiny: 4 MoE layers, d = 64, E = 8, top-2; 100 tokens, EP = 4, bf16
    got = a2a_bytes_per_step(_cfg("tiny"), tokens=100, ep=4, dtype_bytes=2)
    one_way = 100 * 2 * 64 * 2 * 3 / 4  # dispatch bytes of one layer, forward = 19200
    assert one_way == 19200
    assert got["token_layers"] == 4 * 4 * one_way  # 4 layers x (dispatch + combine) x (fwd + bwd)
    assert got["concept_layers"] == 0
    assert got["forward"] == got["backward"] == 2 * 4 * one_way
    assert got["counts"] == 4 * 8 * 8 * 3 / 4  # E int64 split sizes per layer, 3/4 leave the rank
    assert got["total"] == 307200 + 192 and got["per_token"] == got["total"] / 100


def test_scales_with_ep_fraction():
    cfg = _cfg("tiny")
    b = {ep: a2a_bytes_per_step(cfg, 4096, ep)["token_layers"] for ep in (1, 2, 4, 8)}
    assert b[1] == 0  # one rank holds every expert: nothing moves
    for ep in (2, 4, 8):
        assert b[ep] / b[2] == pytest.approx(((ep - 1) / ep) / (1 / 2))
    one, two = a2a_bytes_per_step(cfg, 4096, 4), a2a_bytes_per_step(cfg, 2 * 4096, 4)
    assert two["token_layers"] == 2 * one["token_layers"] and two["counts"] == one["counts"]  # counts: per layer


def test_concept_layers_by_hand_and_one_over_R():
    # tiny_concept: encoder 1, concept 2, decoder 1; R = 2, concept top-k = top-k = 2
    cfg = _cfg("tiny_concept")
    got = a2a_bytes_per_step(cfg, tokens=100, ep=4)
    assert got["token_layers"] == 2 * 4 * 19200
    assert got["concept_layers"] == 2 * 4 * (50 * 2 * 64 * 2 * 3 / 4)  # 50 concepts
    assert got["concept_tokens"] == 50
    con = {R: a2a_bytes_per_step(cfg, 100, 4, ratio=R)["concept_layers"] for R in (1.0, 2.0, 4.0)}
    assert con[2.0] == con[1.0] / 2 and con[4.0] == con[1.0] / 4
    assert a2a_bytes_per_step(cfg, 100, 4, ratio=4.0)["token_layers"] == got["token_layers"]  # token layers keep N


def test_concept_top_k_width_and_loops():
    cfg = _cfg("tiny_concept", concept_top_k=3, concept_hidden_size=96)
    got = a2a_bytes_per_step(cfg, tokens=100, ep=4)
    assert got["concept_layers"] == 2 * 4 * (50 * 3 * 96 * 2 * 3 / 4)  # own top-k and width d_c
    looped = a2a_bytes_per_step(_cfg("tiny_concept", concept_loop_layers=[0], concept_loop_times=3), 100, 4)
    plain = a2a_bytes_per_step(_cfg("tiny_concept"), 100, 4)
    assert looped["concept_layers"] == plain["concept_layers"] * (3 + 1) / 2  # layer 0 runs 3 times, layer 1 once
    assert looped["moe_layers"] == plain["moe_layers"] + 2
    dense = a2a_bytes_per_step(_cfg("tiny", first_k_dense=1), 100, 4)
    assert dense["token_layers"] == 3 * 4 * 19200 and dense["moe_layers"] == 3  # a dense layer sends nothing


def test_expert_params_match_the_model():
    from vlm.modeling.modeling_conceptmoe import ConceptMoEForCausalLM
    for cfg in (_cfg("tiny"), _cfg("tiny_concept", concept_hidden_size=96), _cfg("tiny", first_k_dense=1)):
        with torch.device("meta"):
            model = ConceptMoEForCausalLM(cfg)
        names = ("w_gate_up", "w_down")
        numel = sum(p.numel() for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in names)
        assert expert_params(cfg) == numel == count_params(cfg)["experts"]
    assert expert_params(_cfg("tiny")) == 4 * 3 * 8 * 64 * 128


def test_memory_zero1_zero2_by_hand():
    cfg = _cfg("tiny")
    P = 4 * 3 * 8 * 64 * 128
    z2_1, z2_4 = expert_memory_per_gpu(cfg, 1, 4, 2), expert_memory_per_gpu(cfg, 4, 4, 2)
    assert z2_1["weights"] == 2 * P and z2_1["grads"] == 2 * P / 4 and z2_1["optimizer"] == 12 * P / 4
    assert z2_4["weights"] == 2 * P / 4 and z2_4["grads"] == 2 * P / 4 and z2_4["optimizer"] == 12 * P / 4
    assert z2_1["total"] - z2_4["total"] == 2 * P * 3 / 4  # EP saves the replicated bf16 weights
    z1_1, z1_4 = expert_memory_per_gpu(cfg, 1, 4, 1), expert_memory_per_gpu(cfg, 4, 4, 1)
    assert z1_1["total"] == (2 + 2 + 3) * P and z1_4["total"] == (0.5 + 0.5 + 3) * P  # ZeRO-1: grads unpartitioned
    # 8 GPUs, EP = 2: expert ZeRO state over the 4-rank expert-data-parallel group
    m = expert_memory_per_gpu(cfg, 2, 8, 2)
    assert m["weights"] == P and m["grads"] == 2 * P / 8 and m["optimizer"] == 12 * P / 8
    assert zero3_gather_bytes(cfg, 4) == 3 * 2 * P * 3 / 4
    with pytest.raises(ValueError):
        expert_memory_per_gpu(cfg, 2, 8, 3)
    with pytest.raises(ValueError):
        expert_memory_per_gpu(cfg, 3, 8, 2)


def test_paper_presets():
    moe, con = _cfg("moe_a05b_12b"), _cfg("concept_a05b_12b")
    m, c = a2a_bytes_per_step(moe, 8192, 8), a2a_bytes_per_step(con, 8192, 8)
    per_layer = 4 * 8192 * 8 * 1024 * 2 * 7 / 8
    assert m["token_layers"] == 24 * per_layer
    assert c["token_layers"] == 8 * per_layer  # 4 encoder + 4 decoder layers
    assert c["concept_layers"] == 16 * per_layer * (17 / 8) / 2  # concept top-17 on 8192 / 2 concepts
    same_k = a2a_bytes_per_step(_cfg("concept_a05b_12b", concept_top_k=8), 8192, 8)
    assert same_k["concept_layers"] == 16 * per_layer / 2  # R = 2 alone halves the concept layers' traffic


def test_cli_ep_table(capsys):
    assert main(["--config", str(PRESETS / "tiny.yaml"), "--match-to", str(PRESETS / "tiny_concept.yaml"),
                 "--ep", "4", "--tokens-per-gpu", "100", "--world", "4"]) == 0
    out = capsys.readouterr().out
    assert "| EP = 4 on 4 GPUs, 100 tokens/GPU/step" in out and "| tiny | tiny_concept |" in out
    assert "| all-to-all bytes/step/GPU (fwd+bwd) | 307.4KB | 230.6KB |" in out  # 307200 + 192; 230400 + 192
