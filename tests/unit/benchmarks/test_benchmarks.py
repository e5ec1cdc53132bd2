"""Smoke runs of the benchmark scripts (benchmarks/*.py): tiny sizes, one round, JSON keys checked.

Benchmarks are not tests: these only prove every script runs end to end and writes the result
files `make bench` and benchmarks/gpu.sh rely on. The figures themselves are meaningless here.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import (
    attention, dechunk, decode, expert_parallel, inference, moe, prefill, run_all, serving, serving_admission, train,
    train_packed, vs_transformers,
)
from benchmarks.inference_modes import Mode
from benchmarks.cli import parse_sizes
from benchmarks.harness import interleaved, peak_memory, peak_memory_interleaved, stats
from benchmarks.model_pair import build_model, load_pair, random_ids

SMOKE = ["--smoke", "--threads", "1"]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench")


def _run(module, out_dir, *extra):
    payload = module.run([*SMOKE, "--out", str(out_dir), *extra])
    name = payload["name"]
    for suffix in (".json", ".md", ".png"):
        assert (out_dir / f"{name}{suffix}").is_file(), f"{name}{suffix} missing"
    data = json.loads((out_dir / f"{name}.json").read_text())
    assert data["partial"] is False
    for key in ("settings", "machine", "results"):
        assert key in data
    assert data["settings"]["threads"] == 1 and data["settings"]["smoke"] is True
    assert data["machine"]["torch"] == torch.__version__
    return data


@pytest.fixture(scope="module")
def prefill_data(out_dir):
    return _run(prefill, out_dir)


@pytest.fixture(scope="module")
def decode_data(out_dir):
    return _run(decode, out_dir)


@pytest.fixture(scope="module")
def inference_data(out_dir):  # transformers' compiled mode is left out: a CPU compile takes a minute
    return _run(inference, out_dir, "--modes", "ours,ours_R2,hf_static")


@pytest.fixture(scope="module")
def moe_data(out_dir):
    return _run(moe, out_dir)


@pytest.fixture(scope="module")
def train_data(out_dir):
    return _run(train, out_dir)


@pytest.fixture(scope="module")
def train_packed_data(out_dir):
    return _run(train_packed, out_dir)


@pytest.fixture(scope="module")
def attention_data(out_dir):
    return _run(attention, out_dir)


@pytest.fixture(scope="module")
def dechunk_data(out_dir):
    return _run(dechunk, out_dir)


@pytest.fixture(scope="module")
def expert_parallel_data(out_dir):
    return _run(expert_parallel, out_dir)


@pytest.fixture(scope="module")
def vs_transformers_data(out_dir):
    return _run(vs_transformers, out_dir)


def test_prefill_smoke(prefill_data):
    res = prefill_data["results"]
    assert [r["seq_len"] for r in res] == prefill.PRESETS["smoke"]
    for r in res:
        assert r["achieved_ratio"] == pytest.approx(2.0)  # fixed boundaries: exactly R
        for key in ("moe_s", "concept_s", "speedup", "predicted_speedup_full_map", "predicted_speedup_causal",
                    "measured_over_predicted", "raw_times"):
            assert key in r
        assert r["moe_s"]["median"] > 0 and r["concept_s"]["median"] > 0
        assert r["predicted_speedup_full_map"] > r["predicted_speedup_causal"] > 0
    pair = prefill_data["pair"]
    assert pair["boundary_mode"] == "fixed" and pair["split"] == "1/2/1"
    assert pair["concept_top_k"] > pair["top_k"]  # strategy 1 gives the saved FLOPs back as experts
    check = prefill_data["flop_check"]
    assert check["moe"]["counted_over_accountant"] == pytest.approx(1.0, rel=1e-6)
    assert check["concept"]["counted_over_accountant"] == pytest.approx(1.0, rel=1e-6)


def test_decode_smoke(decode_data):
    res = decode_data["results"]
    assert {(r["batch"], r["kv_len"]) for r in res} == {(b, n) for b in (1, 2) for n in decode.PRESETS["smoke"]}
    for r in res:
        for key in ("moe_s_per_step", "concept_s_per_step", "speedup", "predicted_speedup_flops"):
            assert key in r
        # fixed boundaries, synthetic fill: N/R concepts + one per 2 decoded tokens
        assert r["concept_cache_entries_after"][0] >= r["kv_len"] // 2
        held, allocated = r["concept_kv_after"]["held_bytes"], r["concept_kv_after"]["allocated_bytes"]
        assert 0 < held <= allocated
        for tag in ("moe", "concept"):
            kv = r["kv_after"][tag]
            assert 0 < kv["held_bytes"] <= kv["allocated_bytes"]
        # a decode step: the plain MoE reads nothing on the host, the ConceptMoE its boundaries once
        assert r["counts"]["moe"]["syncs_per_step"] == 0 and r["counts"]["concept"]["syncs_per_step"] == 1
        assert r["counts"]["moe"]["ops_per_step"] > 0
    kv = decode_data["kv_bytes"][0]
    # concept layers hold 1/R of a baseline layer's bytes (within 5%), and match the formula
    assert abs(kv["concept_layer_rel_error_vs_1_over_R"]) < 0.05
    for tag in ("moe", "concept"):
        assert kv[tag]["measured_over_formula"]["total"] == pytest.approx(1.0, rel=1e-6)


def test_inference_smoke(inference_data):
    d = inference_data
    assert d["modes"] == ["ours", "ours_R2", "hf_static"] and d["shape"] == inference.SHAPES["smoke"]
    (pre,) = d["results"]["prefill"]
    assert pre["logit_gap_ours_vs_hf"] < 1e-4  # the same weights: the same logits
    assert pre["reference"] == "hf_static" and pre["vs_reference"]["hf_static"]["median"] == pytest.approx(1.0)
    assert [(r["batch"], r["kv_len"]) for r in d["results"]["decode"]] == [(1, 32), (2, 32)]
    for r in d["results"]["decode"]:
        assert set(r["ms_per_step"]) == {"ours", "ours_R2", "hf_static"} and not r["failed"]
        for kv in r["kv"].values():
            assert 0 < kv["held_bytes"] <= kv["allocated_bytes"]
    for B in ("1", "2"):
        c = d["results"]["counts"][B]
        assert c["ours"]["syncs_per_step"] == 0 and c["ours_R2"]["syncs_per_step"] == 1
        assert c["hf_static"]["syncs_per_step"] == 0 and c["hf_static"]["ops_per_step"] > 0
    syncs = [t for t in d["targets"] if t["what"].startswith("host syncs")]
    assert len(syncs) == 4 and all(t["met"] for t in syncs)
    assert all(t["met"] is None for t in d["targets"] if t["what"].startswith("GPU"))  # not on this device


def test_inference_targets_follow_the_counts():
    """Met / missed comes from the counts: more ops than transformers' StaticCache, or a sync the target
    does not allow, is missed."""
    def c(ops, syncs):
        return {"ops_per_step": ops, "syncs_per_step": syncs}
    counts = {1: {"ours": c(90, 0), "ours_R2": c(110, 1), "hf_static": c(100, 0)}}
    got = {(t["mode"], t["what"].split(" (")[0]): t["met"] for t in inference.targets(counts, [], 4, False)}
    assert got == {("ours", "decode ops per step / transformers' StaticCache"): True,
                   ("ours", "host syncs per decode step"): True,
                   ("ours_R2", "decode ops per step / transformers' StaticCache"): False,
                   ("ours_R2", "host syncs per decode step"): True}
    counts[1]["ours"] = c(90, 1)
    assert not next(t for t in inference.targets(counts, [], 4, False)
                    if t["mode"] == "ours" and t["what"].startswith("host syncs"))["met"]


def test_inference_a_mode_that_cannot_run_is_reported(monkeypatch):
    """A mode whose step raises (a compile unsupported here) is left out of the rounds and named in the
    table with its reason; the other modes are still timed."""
    from benchmarks.cli import Settings

    class Broken(Mode):
        label = "broken"

        def start(self, B, cap):
            return None

        def prefill(self, cache, ids):
            return None

        def step(self, cache, tok, pos):
            raise RuntimeError("backend cannot compile this\nsecond line")

    class Fine(Broken):
        label = "fine"

        def step(self, cache, tok, pos):
            return tok

        def kv(self, cache, filled):
            return {"allocated_bytes": 1, "held_bytes": 1}
    s = Settings("inference", torch.device("cpu"), torch.float32, "smoke", [8], 1, 0, 1, None, 0, True)
    modes = {"hf_static": Fine(), "hf_static_compiled": Broken()}
    r = inference.bench_decode(modes, 1, 8, 2, 16, 100, s, lambda m: None)
    assert r["failed"] == {"hf_static_compiled": "RuntimeError: backend cannot compile this"}
    assert set(r["ms_per_step"]) == {"hf_static"} and r["reference"] == "hf_static"


def test_speedup_targets_judge_the_gpu_rows_only():
    """prefill / decode's issue-35 targets: met or missed from the measured speedup at the target sizes, on
    a GPU; elsewhere listed without a value or verdict."""
    from benchmarks.report import speedup_targets, targets_md

    rows = [{"seq_len": 1024, "speedup": {"median_of_ratios": 0.9}},
            {"seq_len": 8192, "speedup": {"median_of_ratios": 0.30}},
            {"seq_len": 32768, "speedup": {"median_of_ratios": 0.59}}, {"seq_len": 65536, "skipped": "oom"}]
    gpu = speedup_targets(rows, "seq_len", prefill.TARGETS, "prefill", True)
    assert [(t["size"], t["met"]) for t in gpu] == [(8192, True), (32768, False)]
    assert "32,768, batch 1: +59.0% -> MISSED" in targets_md(gpu)
    cpu = speedup_targets(rows, "seq_len", prefill.TARGETS, "prefill", False)
    assert [(t["value"], t["met"]) for t in cpu] == [(None, None), (None, None)]
    assert decode.TARGETS == {8192: 0.20}


def test_inference_refuses_unknown_modes(tmp_path):
    with pytest.raises(SystemExit) as e:
        inference.run(["--smoke", "--out", str(tmp_path), "--modes", "ours,ours_fast"])
    assert e.value.code == 2


def test_moe_smoke(moe_data):
    assert moe_data["shape"] == moe.SHAPES["smoke"]
    for entry in moe_data["results"]:
        for name, diff in entry["max_abs_diff_vs_ours"].items():
            assert diff < 1e-4, f"{name} disagrees with ours: {diff}"  # same weights -> same outputs
        for mode in ("forward", "forward+backward"):
            variants = entry[mode]["variants"]
            assert {"ours_sorted", "ours_loop", "hf_eager"} <= set(variants)
            assert entry[mode]["peak_flops_per_s"] > 0
            for v in variants.values():
                assert v["tokens_per_s"] > 0 and 0 < v["fraction_of_peak"] < math.inf


def test_train_smoke(train_data):
    r = train_data["results"][0]
    for tag in ("moe", "concept"):
        for key in ("step_s", "tokens_per_s", "train_flops_per_token", "mfu", "mfu_causal"):
            assert key in r[tag]
        assert r[tag]["mfu"] > 0
        assert all(math.isfinite(x) for x in r[tag]["loss_first_last"])
    assert r["achieved_ratio"] == pytest.approx(2.0)


def test_train_packed_smoke(train_packed_data):
    d = train_packed_data
    assert d["boundary_mode"] == "dynamic"  # the learned router, not fixed boundaries
    cal = d["calibration"]
    assert cal["steps"] >= 3 and cal["within_tolerance"]  # eval R within 10% of the target
    assert abs(cal["eval_ratio_after"] / cal["target_ratio"] - 1) <= train_packed.R_TOLERANCE
    res = d["results"]
    assert [r["seq_len"] for r in res] == train_packed.PRESETS["smoke"]
    for r in res:
        assert all(n > 1 for n in r["docs_per_row"])  # packed: several documents per row
        assert r["concept_over_moe_time"]["median"] > 0 and r["concept_over_moe_memory"] > 0
        assert 1.0 < r["achieved_ratio_train"] < 4.0 and 1.0 < r["achieved_ratio_eval"] < 4.0
        for tag in ("moe", "concept"):
            assert r[tag]["tokens_per_s"] > 0 and r[tag]["peak_bytes"] > 0
            assert all(math.isfinite(x) for x in r[tag]["loss_first_last"])
        assert 1 <= r["mean_doc_len"] < r["seq_len"]
        assert r["predicted_speedup_causal"] < r["predicted_speedup_full_map"]


def test_train_packed_prediction_counts_attention_per_document():
    base, con, _ = load_pair("smoke", 2.0, seq_len=64, boundary_mode="dynamic")
    seg = torch.tensor([[1, 1, 1, 2, 0, 0]])  # documents of 3 and 1 tokens, 2 padding
    assert train_packed.predicted(base, con, seg, 2.0)["mean_doc_len"] == pytest.approx((9 + 1) / 4)
    short = train_packed.predicted(base, con, torch.arange(1, 4097).repeat_interleave(16)[None], 2.0)
    whole = train_packed.predicted(base, con, torch.ones(1, 65536, dtype=torch.long), 2.0)
    assert short["mean_doc_len"] == 16 and whole["mean_doc_len"] == 65536
    # the attention map is what ConceptMoE shrinks by R^2: long documents give the larger speedup
    assert short["predicted_speedup_causal"] < whole["predicted_speedup_causal"]


def test_packed_batch_layout():
    b = train_packed.packed_batch(2, 100, 10, 50, torch.device("cpu"), seed=3)
    seg, pos, lab = b["segment_ids"], b["position_ids"], b["labels"]
    starts = pos == 0
    assert torch.equal(starts[:, 1:], seg[:, 1:] != seg[:, :-1])  # positions restart at every new document
    assert bool(starts[:, 0].all()) and bool((lab[starts] == -100).all()) and bool((lab[~starts] >= 0).all())
    assert [int(seg[i].max()) for i in range(2)] == b["docs_per_row"]


def test_attention_smoke(attention_data):
    res = attention_data["results"]
    assert [r["seq_len"] for r in res] == attention.PRESETS["smoke"]
    for r in res:
        for k in ("dense", "layout", "rows"):
            assert r[k]["time_s"]["median"] > 0 and r[k]["peak_bytes"] > 0
        assert r["dense_bytes"] == r["seq_len"] ** 2  # the [1, 1, T, T] bool mask
        assert r["layout_over_rows_time"]["median"] > 0
    assert "target" in res[-1]


def test_attention_variants_agree():
    """The three timed variants compute the same attention (dense mask, layout, separate rows)."""
    from vlm.modeling.attention import causal_mask
    from vlm.modeling.varlen import DocLayout
    layer, cfg = attention.build_layer(32, 4, 2, torch.device("cpu"), torch.float32)
    x = attention.packed_inputs(64, attention.DOCS, layer, cfg, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        dense = layer(x["x"], x["cos_sin"], mask=causal_mask(None, x["seg"], 64, torch.device("cpu")))
        lay = layer(x["x"], x["cos_sin"], mask=DocLayout.build(None, x["seg"]))
        rows = layer(x["x"].view(attention.DOCS, -1, 32), x["rows_cos_sin"], mask=None).reshape(1, 64, 32)
    torch.testing.assert_close(lay, dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rows, dense, atol=1e-5, rtol=1e-5)


def test_dechunk_smoke(dechunk_data):
    res = dechunk_data["results"]
    assert [r["concepts"] for r in res] == dechunk.PRESETS["smoke"]
    assert res[0]["over_smallest"]["median"] == pytest.approx(1.0)
    for r in res:
        assert r["tokens"] == 2 * r["concepts"] and r["time_s"]["median"] > 0
    assert [t["target"] for t in dechunk_data["targets"]] == [None]  # smoke sizes: the 16K / 1K target does not apply
    ops = [r["aten_ops"] for r in res]  # one scan whatever M: the same op count at 64 and 256 concepts
    assert ops[0] == ops[1] <= dechunk.TARGET_OPS and dechunk_data["targets"][0]["ops_met"]


@pytest.mark.integration  # starts ranks (expert_parallel_data)
def test_expert_parallel_smoke(expert_parallel_data):
    d = expert_parallel_data
    assert d["ranks"] == 2 and d["shape"] == expert_parallel.SHAPES["smoke"]
    (r,) = d["results"]
    assert r["tokens_per_rank"] == expert_parallel.PRESETS["smoke"][0]
    assert r["ep_over_dp"]["median"] > 0 and 0 < r["exchange_share_of_ep"]["median"]
    for rank in r["per_rank"]:
        assert max(rank["max_abs_diff"].values()) < 1e-5  # EP computes the layer DP computes
        assert 0 < rank["rows_sent"] < rank["assignments"]  # some assignments leave the rank, not all
    presets = d["accountant"]["presets"]
    moe_b, con_b = (presets[n]["all-to-all bytes/step/GPU (fwd+bwd)"] for n in expert_parallel.PAPER)
    assert moe_b > 0 and con_b > 0 and presets[expert_parallel.PAPER[0]]["saved by EP=8"] > 0


def test_vs_transformers_smoke(vs_transformers_data):
    d = vs_transformers_data
    assert set(d["results"]) == {"olmoe", "qwen3_moe"} and d["transformers"]
    for fam, r in d["results"].items():
        (t,) = r["train"]
        assert set(t["vs_hf"]) == set(vs_transformers.TRAIN[1:])
        for cell in t["vs_hf"].values():
            assert cell["time_ratio"] > 0
        assert t["R2_achieved_ratio"] > 1
        assert [x["batch"] for x in r["decode"]] == [1, 2]
        for x in r["decode"]:
            # same weights: our prefill and first decode step give transformers' logits
            assert x["prefill_logit_gap_vs_hf"] < 1e-4 and x["decode_logit_gap_vs_hf_static"] < 1e-4, fam
            assert set(x["decode"]["vs_hf_static"]) == {"hf_dynamic", "ours", "ours_R2"}
            kv = x["kv"]
            assert 0 < kv["ours_R2"]["held_bytes"] <= kv["ours_R2"]["allocated_bytes"]
            assert 0 < x["R2_concept_held_over_plain"] <= x["R2_concept_allocated_over_plain"]
            assert x["R2_prompt_ratio"] > 1


def test_vs_transformers_refuses_unknown_parts_and_variants(tmp_path):
    """``--parts`` / ``--train-variants`` outside the known names: one clear line, exit 2, nothing built."""
    for bad in (["--parts", "train,prefil"], ["--train-variants", "ours_fast"]):
        with pytest.raises(SystemExit) as e:
            vs_transformers.run(["--smoke", "--out", str(tmp_path), *bad])
        assert e.value.code == 2, bad


def test_peak_memory_sees_an_allocation():
    got = peak_memory(lambda: torch.ones(64 * 2**20 // 4).add_(1), torch.device("cpu"))
    assert got["bytes"] >= 32 * 2**20, got  # a 64 MiB tensor (RSS-based: page-granular, allow slack)


def test_peak_memory_variants_take_turns():
    calls = []
    fns = {k: (lambda k=k, n=n: calls.append(k) or torch.ones(n * 2**20 // 4).add_(1)) for k, n in (("a", 64), ("b", 1))}
    got = peak_memory_interleaved(fns, torch.device("cpu"), 4)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]  # each round rotated: no variant always goes first
    assert len(got["a"]["samples"]) == len(got["b"]["samples"]) == 4
    assert got["a"]["bytes"] >= 32 * 2**20 > got["b"]["bytes"], got


@pytest.mark.integration  # its expert_parallel_data fixture starts ranks
def test_summary(out_dir, prefill_data, decode_data, inference_data, moe_data, train_data, train_packed_data, attention_data,
                 dechunk_data, expert_parallel_data, vs_transformers_data):
    assert run_all.main(["--summary-only", "--out", str(out_dir)]) == 0
    text = (out_dir / "SUMMARY.md").read_text()
    for title in ("Prefill latency", "BEST CASE", "Decode latency", "Inference: which to pick", "MoE layer", "Training throughput",
                  "Training step on packed rows", "dense mask vs document layout", "Dechunk scaling",
                  "Expert parallelism", "Ours vs transformers"):
        assert title in text
    assert "| train_packed | ok, git " in text  # files of several runs: each names its commit
    assert set(run_all.BENCHMARKS) >= {"inference", "train_packed", "attention", "dechunk", "expert_parallel", "vs_transformers"}


def test_synthetic_fill_matches_real_prefill():
    """decode.py's synthetic cache fill leaves the same lengths and decode fields as a real prefill."""
    base, con, _ = load_pair("smoke")
    model = build_model(con, torch.device("cpu"), torch.float32)
    N, B = 20, 2
    with torch.inference_mode():
        real = model.start_decoding(B, N + 8)
        model.prefill(real, random_ids(B, N, con.vocab_size, torch.device("cpu")))
        fake = model.start_decoding(B, N + 8)
        decode.synthetic_fill(model, fake, B, N)
        for a, b in zip(real.token_caches + real.concept_caches, fake.token_caches + fake.concept_caches):
            assert torch.equal(a.len_B, b.len_B) and torch.equal(a.valid_BC, b.valid_BC)
            assert (a.size, a.ragged, a.dense) == (b.size, b.ragged, b.dense)
            assert a.nbytes() == b.nbytes()
        assert torch.equal(real.next_pos_B, fake.next_pos_B)
        for field in ("prev_k_BD", "ema_BD", "has_ema_B"):
            ra, fa = getattr(real, field), getattr(fake, field)
            assert ra.shape == fa.shape and ra.dtype == fa.dtype, field
        tok = torch.ones(B, dtype=torch.long)
        for _ in range(3):  # both states decode
            assert model.step(real, tok).shape == model.step(fake, tok).shape


def test_interleaving_and_stats():
    calls = []
    comp = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                               torch.device("cpu"), reps=3, warmup=1)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]  # order flips every round
    assert len(comp.times["a"]) == 3 and comp.order == [["b", "a"], ["a", "b"], ["b", "a"]]
    st = stats([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (st["median"], st["q1"], st["q3"]) == (3.0, 2.0, 4.0)
    comp.times = {"a": [2.0, 2.0, 2.0], "b": [1.0, 1.0, 1.0]}
    assert comp.speedup("a", "b")["median_of_ratios"] == pytest.approx(1.0)  # b is 100% faster


def test_size_parsing():
    assert parse_sizes("1K,2k,300", {}, "cpu") == ("custom", [1024, 2048, 300])
    assert parse_sizes(None, {"cpu": [1, 2]}, "cpu") == ("cpu", [1, 2])


def test_serving_smoke(out_dir):
    d = _run(serving, out_dir)
    assert [r["concurrency"] for r in d["results"]] == serving.PRESETS["smoke"]
    for r in d["results"]:
        assert r["engine"]["tokens"] == r["sequential"]["tokens"] == r["static_batch"]["tokens"]
        assert r["engine"]["peak_rows"] == r["concurrency"]  # the engine batched every request
    adm = d["admission"]
    run_pair, e = adm["run_pair"], adm["engine"]
    assert run_pair["concept_bytes"] < run_pair["moe_bytes"] and run_pair["concept_admitted"] > run_pair["moe_admitted"]
    for k in ("moe", "concept"):  # the engine admitted exactly the planned rows of the run's pair
        assert e[k]["peak_rows"] == e[k]["planned"] == run_pair[f"{k}_admitted"]
    assert [r["layout"] for r in adm["layouts"]] == [label for label, _ in serving_admission.LAYOUTS]
    assert [t["target"] for t in d["targets"]] == [4.0] + [1.8] * (1 + len(adm["layouts"]))
    assert d["targets"][1]["value"] == e["peak_ratio"]  # the target row: the run's pair, engine-measured
