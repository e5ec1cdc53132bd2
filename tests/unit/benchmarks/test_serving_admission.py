"""KV admission, ConceptMoE vs matched MoE (benchmarks/serving_admission.py): the real engine's peak rows
under a budget equal the budget over a request's bytes counted here from the config (concept layers at
capacity / R + headroom, not at the capacity), and the planned layouts match the structural bound
L / (L_E + L_D + L_C / R)."""
from __future__ import annotations

import math

import pytest
import torch

from benchmarks.serving import _Numbers
from benchmarks.serving_admission import TARGET, engine_admission, plan_layouts
from vlm.modeling.decode_pool import capacity_bucket
from vlm.modeling.generation import planned_ratio


def cache_bytes(cfg, slots: int, elem: int) -> int:
    """One layer's cache for one request: K and V [kv, slots, head_dim], the valid mask [slots] (bool)
    and the length [1] (int64)."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_key_value_heads * slots * head_dim * elem + slots + 8


def request_bytes(cfg, capacity: int, elem: int) -> int:
    """A request's KV bytes from the config alone: token layers at ``capacity``; concept layers at
    ceil(capacity / R) + headroom."""
    if not cfg.chunking:
        return cfg.num_hidden_layers * cache_bytes(cfg, capacity, elem)
    token_layers = cfg.encoder_layers + cfg.decoder_layers
    concept_slots = math.ceil(capacity / planned_ratio(cfg)) + cfg.runtime.concept_headroom
    return (token_layers * cache_bytes(cfg, capacity, elem)
            + (cfg.num_hidden_layers - token_layers) * cache_bytes(cfg, concept_slots, elem))


def test_engine_peak_rows_are_the_budget_over_each_requests_bytes(tiny_model):
    moe, concept = tiny_model("tiny"), tiny_model("tiny_concept")
    capacity, budget_requests = 256, 16
    got = engine_admission(moe, concept, _Numbers(), capacity=capacity, budget_requests=budget_requests)
    moe_b, con_b = (request_bytes(m.config, capacity, 4) for m in (moe, concept))
    budget = budget_requests * moe_b
    assert got["budget_bytes"] == budget
    assert got["moe"]["bytes_per_request"] == moe_b and got["concept"]["bytes_per_request"] == con_b
    # measured by the engine: a concept cache counted at full capacity would give the MoE's 16
    assert got["moe"]["peak_rows"] == got["moe"]["planned"] == budget_requests
    assert got["concept"]["peak_rows"] == got["concept"]["planned"] == budget // con_b > budget_requests
    assert got["concept"]["requests"] > got["concept"]["peak_rows"]  # the budget, not the requests, bound it
    assert got["matches_plan"] and got["peak_ratio"] == (budget // con_b) / budget_requests


def test_the_plan_counts_a_request_at_its_slot_between_capacity_buckets(tiny_model):
    """The engine's slots hold the capacity rounded up to its capacity bucket (200 -> 208 token slots):
    the planned bytes and rows are those, so the engine admits exactly the planned rows."""
    moe, concept = tiny_model("tiny"), tiny_model("tiny_concept")
    capacity, slots = 200, capacity_bucket(200)
    assert slots > capacity
    got = engine_admission(moe, concept, _Numbers(), capacity=capacity, budget_requests=8)
    assert [got[k]["bytes_per_request"] for k in ("moe", "concept")] == [
        request_bytes(m.config, slots, 4) for m in (moe, concept)]
    assert got["moe"]["peak_rows"] == got["moe"]["planned"] == 8 and got["matches_plan"]


SPLITS = {"CPU pair": (1, 2, 1), "speed pair": (4, 24, 4), "12B pair": (4, 16, 4), "1L at 32 layers (solved)": (1, 30, 1)}


def test_planned_layouts_follow_the_structural_bound():
    rows = plan_layouts(torch.bfloat16)
    assert [r["layout"] for r in rows] == list(SPLITS)
    for r in rows:
        e, c, d = SPLITS[r["layout"]]
        L = e + c + d
        assert r["split"] == f"{e}/{c}/{d} of {L}"
        assert r["bound"] == pytest.approx(L / (e + d + c / 2))  # R = 2
        assert r["concept_admitted"] == r["budget_bytes"] // r["concept_bytes"]
        assert r["moe_admitted"] == 32
        # headroom and whole requests keep it just under the bound (within 1/16)
        assert r["bound"] - 1 / 16 < r["admitted_ratio"] <= r["bound"]
        assert r["meets_target"] == (r["admitted_ratio"] >= TARGET)
        assert abs(r["param_diff"]) < 0.02 and abs(r["flop_diff_no_attn_map"]) < 0.02  # matched pairs
    # at R = 2 only (L_E + L_D) / L <= 1/9 can reach 1.8x: of these, the 1/30/1 layout
    assert [r["layout"] for r in rows if r["meets_target"]] == ["1L at 32 layers (solved)"]
