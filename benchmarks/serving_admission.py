"""KV admission, ConceptMoE vs its matched MoE: the admission section of benchmarks/serving.py.

The engine admits a request when its caches fit the KV budget, counting the bytes they are allocated at
(``vlm.serving.engine.planned_bytes``): each token layer at the capacity (rounded up to the engine's
capacity bucket, as its slots are), each concept layer at capacity / R + headroom. The MoE's L layers are
all token layers; the ConceptMoE's encoder (L_E) and decoder (L_D) layers stay at full length and only its
L_C concept layers shrink, so under one budget it admits at most

    admitted(ConceptMoE) / admitted(MoE) <= L / (L_E + L_D + L_C / R)

times the MoE's requests (headroom and whole requests lower it a little). At R = 2, 1.8x needs
(L_E + L_D) / L <= 1/9. ``plan_layouts``: the planned figures for several real matched pairs, from a
meta-device allocation (no compute); ``engine_admission``: the real engine's peak concurrent rows
under the budget (it must equal the planned count).
"""
from __future__ import annotations

import time

import torch

from benchmarks.model_pair import MODEL_CONFIGS, build_model, load_pair, random_ids

REQUEST_LEN = 8192  # the long requests
BUDGET_MOE_REQUESTS = 32  # the budget: this many MoE requests' bytes
TARGET = 1.8  # issue 41 item 6: ConceptMoE admits >= 1.8x the MoE's concurrent requests at R = 2
EXTRA_REQUESTS = 4  # requests beyond the planned count: the budget, not the supply, must bind
_SPEED = f"{MODEL_CONFIGS / 'bench_moe_top8.yaml'}"
# (label, load_pair spec): the CPU benchmark pair, the project's paper-shaped speed pair, the paper-like
# 12B pair, and the "1L" shape (L_E = L_D = 1) at the speed pair's depth, solved by vlm.flops.solve_match
LAYOUTS = (("CPU pair", "cpu"),
           ("speed pair", f"{_SPEED}:{MODEL_CONFIGS / 'bench_1l_top24_r2.yaml'}"),
           ("12B pair", f"{MODEL_CONFIGS / 'moe_a05b_12b.yaml'}:{MODEL_CONFIGS / 'concept_a05b_12b.yaml'}"),
           ("1L at 32 layers (solved)", _SPEED))


def structural_bound(base, con) -> float:
    """L / (L_E + L_D + L_C / R): the MoE's cache count over the ConceptMoE's in full-length units
    (concept caches at 1 / R each, R the ratio they are sized for; headroom left out)."""
    from vlm.modeling.generation import planned_ratio
    from vlm.serving.engine import planned_state
    n_moe = len(planned_state(base, 1).token_caches)
    state = planned_state(con, 1)
    return n_moe / (len(state.token_caches) + len(state.concept_caches) / planned_ratio(con.config))


def plan(base, con, request_len: int = REQUEST_LEN, budget_requests: int = BUDGET_MOE_REQUESTS) -> dict:
    """Planned KV bytes per ``request_len``-token request and the requests admitted under the bytes of
    ``budget_requests`` MoE requests, for the models ``base`` (MoE) and ``con`` (ConceptMoE; any device,
    meta included: nothing is computed)."""
    from vlm.serving.engine import planned_bytes
    moe_b, con_b = planned_bytes(base, request_len), planned_bytes(con, request_len)
    budget = budget_requests * moe_b
    cfg = con.config
    return {"split": f"{cfg.encoder_layers}/{cfg.num_hidden_layers - cfg.encoder_layers - cfg.decoder_layers}/"
                     f"{cfg.decoder_layers} of {base.config.num_hidden_layers}",
            "request_len": request_len, "budget_bytes": budget, "moe_bytes": moe_b, "concept_bytes": con_b,
            "moe_admitted": budget // moe_b, "concept_admitted": budget // con_b,
            "admitted_ratio": (budget // con_b) / (budget // moe_b), "bound": structural_bound(base, con)}


def plan_layouts(dtype: torch.dtype, ratio: float = 2.0, strategy: str = "topk", layouts=LAYOUTS) -> list[dict]:
    """``plan`` for each (label, pair spec) of ``layouts``, both models built on the meta device in
    ``dtype``; each row also says whether it meets ``TARGET``."""
    rows = []
    for label, spec in layouts:
        base_cfg, con_cfg, info = load_pair(spec, ratio, strategy, seq_len=REQUEST_LEN)
        meta = torch.device("meta")
        row = {"layout": label, "baseline_config": info["baseline_config"],
               "concept_config": info.get("concept_config", f"solved ({strategy}, R = {ratio:g})"),
               "concept": info["concept"], "param_diff": info["param_diff"],
               "flop_diff_no_attn_map": info["flop_diff_no_attn_map"],
               **plan(build_model(base_cfg, meta, dtype), build_model(con_cfg, meta, dtype))}
        row["meets_target"] = row["admitted_ratio"] >= TARGET
        rows.append(row)
    return rows


def engine_admission(base, con, tokenizer, capacity: int = REQUEST_LEN, budget_requests: int = BUDGET_MOE_REQUESTS,
                     prompt: int = 4, new: int = 2, timeout: float = 600.0) -> dict:
    """The real engine's admission: for each model an ``Engine`` of ``capacity`` token slots with the
    budget of ``budget_requests`` MoE requests is given ``EXTRA_REQUESTS`` more requests than the budget
    holds, and as many rows (so rows never bind: only the budget can stop it), tiny prompts and ``new``
    tokens (admission is by capacity, not by length), all waiting before its scheduler starts so that its
    first admission fills the budget; its peak concurrent rows (``stats["peak_rows"]``) against the
    planned count, budget // planned bytes."""
    from vlm.serving.engine import Engine, planned_bytes
    from vlm.serving.request import Params, Request
    budget = budget_requests * planned_bytes(base, capacity)
    vocab = base.config.vocab_size
    out = {"capacity": capacity, "budget_bytes": budget}
    for name, model in (("moe", base), ("concept", con)):
        planned = budget // planned_bytes(model, capacity)
        n = planned + EXTRA_REQUESTS
        engine = Engine(model, tokenizer, capacity=capacity, max_rows=n, max_queue=n, kv_budget=budget)
        reqs = [engine.submit(Request(random_ids(1, prompt, vocab, model.device, seed=500 + i), None,
                                      Params(max_tokens=new))) for i in range(n)]
        t0 = time.perf_counter()
        engine.start()
        try:
            for r in reqs:
                r.collect(timeout)
        finally:
            engine.stop()
        out[name] = {"bytes_per_request": planned_bytes(model, capacity), "planned": planned, "requests": n,
                     "peak_rows": engine.stats["peak_rows"], "wall_s": time.perf_counter() - t0}
    out["peak_ratio"] = out["concept"]["peak_rows"] / out["moe"]["peak_rows"]
    out["matches_plan"] = all(out[k]["peak_rows"] == out[k]["planned"] for k in ("moe", "concept"))
    return out
