"""Decode: per-token latency at long KV lengths, ConceptMoE vs matched MoE, plus KV-cache bytes.

Both models hold a KV cache of N tokens (the ConceptMoE's concept layers N / R concepts) and are
timed over the same consecutive decode steps, interleaved; KV bytes come from real caches (allocated:
the k/v buffers the caches reserved; held: their valid entries). Per batch size, the kernel-launching
ops and host syncs of a decode step are counted (``benchmarks/op_counter.py``; on the GPU pair, the
32-layer speed pair of issue 35). Against transformers on the same weights: benchmarks/inference.py.

    python -m benchmarks.decode [--device cuda --dtype bfloat16] [--sizes 1K,8K] [--batches 1,8] [--smoke]
"""
from __future__ import annotations

import math

import torch

from benchmarks.cli import base_parser, logger, setup
from benchmarks.harness import free_memory, interleaved
from benchmarks.model_pair import add_pair_args, build_model, load_pair, random_ids
from benchmarks.op_counter import count_steps
from benchmarks.report import (
    finish, fmt_median_iqr, fmt_num, fmt_pct, fmt_time, md_table, oom_reason, settings_line, speedup_targets,
    targets_md, write_results,
)

NAME = "decode"
PRESETS = {"smoke": [64, 128], "cpu": [1024, 2048, 4096, 8192, 16384],
           "gpu": [1024, 2048, 4096, 8192, 16384, 32768]}
REPS = {"smoke": 1, "cpu": 7, "gpu": 5}
TARGETS = {8192: 0.20}  # issue 35 item 5 (GPU): least decode speedup per step at 8K KV
BYTES_LEN = {"smoke": 128, "cpu": 2048}  # real-prefill length for the KV-bytes table on CPU (synthetic fill)


def synthetic_fill(model, state, batch: int, N: int, seed: int = 0) -> None:
    """Give ``state`` the cache lengths and decode fields a fixed-boundary prefill of N tokens leaves.

    Random keys/values up to N (token layers) and ceil(N / round(R)) (concept layers), and the decode
    state (position, router key, EMA) as ``after_prefill`` sets it: the cost of a decode step depends
    on the cache lengths, not on the cached values. ``--fill synthetic`` (the CPU default) uses it
    where a 16K x batch-8 prefill alone would take minutes.
    """
    cfg = model.config
    g = torch.Generator(device="cpu").manual_seed(seed)
    p = next(model.parameters())

    def fill(cache, n, ragged):  # (the host fields as KVCache.fill sets them: ragged = concept caches)
        for buf in (cache.k, cache.v):
            buf[:, :, :n].copy_(torch.randn(buf[:, :, :n].shape, generator=g).to(buf.dtype) * 0.5)
        cache.valid_BC[:, :n] = True
        cache.len_B.fill_(n)
        cache.size, cache.ragged, cache.dense = n, ragged, not ragged
    for c in state.token_caches:
        fill(c, N, False)
    state.next_pos_B = torch.full((batch,), N, dtype=torch.long, device=p.device)
    if cfg.chunking:
        if cfg.boundary_mode != "fixed":
            raise ValueError("synthetic fill models fixed boundaries (boundary_mode='fixed')")
        M = math.ceil(N / max(1, int(round(cfg.target_ratio))))
        for c in state.concept_caches:
            fill(c, M, True)
        d = cfg.hidden_size
        state.prev_k_BD = torch.randn(batch, d, generator=g).to(p.device)  # query_key is fp32
        state.ema_BD = (torch.randn(batch, d, generator=g) * 0.02).to(p.device, p.dtype)
        state.has_ema_B = torch.ones(batch, dtype=torch.bool, device=p.device)
        state.prev_modality_B = None


def real_fill(model, state, ids) -> None:
    model.prefill(state, ids)


def count_ops(models: dict, B: int, vocab: int, device, every: int) -> dict:
    """Ops and host syncs per decode step of each model after a 16-token prefill at batch B, over a
    whole number of concept periods (``every`` steps: one concept step, the rest token-only); under
    no_grad (inference_mode hides scalar reads from the counter)."""
    P, n = 16, max(every, 4 // every * every)
    out = {}
    with torch.no_grad():
        for tag, m in models.items():
            st = m.start_decoding(B, P + n + 2)
            m.prefill(st, random_ids(B, P, vocab, device, seed=3))
            tok = random_ids(B, 1, vocab, device, seed=5)[:, 0]
            m.step(st, tok)  # outside the count: the first step after a prefill
            out[tag] = count_steps(lambda m=m, st=st, tok=tok: m.step(st, tok), n)
    return out


def kv_after(state) -> dict:
    """Allocated (reserved k/v buffers) and held (valid entries) bytes of every cache of ``state``."""
    caches = list(state.token_caches) + list(state.concept_caches)
    return {"allocated_bytes": sum(c.k.nbytes + c.v.nbytes for c in caches),
            "held_bytes": sum(c.nbytes() for c in caches)}


def cache_bytes(model, state) -> dict:
    """nbytes() of the valid entries per layer group, entries per layer, and allocated bytes."""
    inner = model.model
    n_enc = inner.n_enc
    tok = state.token_caches
    groups = {"encoder": tok[:n_enc], "concept": list(state.concept_caches), "decoder": tok[n_enc:]}
    out = {}
    for name, caches in groups.items():
        out[name] = {"layers": len(caches), "bytes": sum(c.nbytes() for c in caches),
                     "entries_per_layer": [int(c.num_entries().max()) if len(caches) else 0 for c in caches],
                     "allocated_bytes": sum(c.k.nbytes + c.v.nbytes for c in caches)}
    out["total_bytes"] = sum(v["bytes"] for v in out.values() if isinstance(v, dict))
    out["total_allocated_bytes"] = sum(v["allocated_bytes"] for k, v in out.items() if isinstance(v, dict))
    return out


def measure_kv_bytes(base, con, base_cfg, con_cfg, N: int, device, dtype) -> dict:
    """Real prefill of N tokens (batch 1) into fresh caches; bytes per group vs the accountant."""
    from vlm.flops import kv_bytes_per_token
    ids = random_ids(1, N, base_cfg.vocab_size, device, seed=N)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    res = {"seq_len": N, "batch": 1, "dtype_bytes": dtype_bytes}
    with torch.inference_mode():
        for tag, model, cfg in (("moe", base, base_cfg), ("concept", con, con_cfg)):
            state = model.start_decoding(1, N + 8)
            real_fill(model, state, ids)
            measured = cache_bytes(model, state)
            ratio = None
            if cfg.chunking:
                out = model._last_prefill
                ratio = N / float(out.num_concepts_B.float().mean())
            formula = kv_bytes_per_token(cfg, ratio=ratio, dtype_bytes=dtype_bytes)
            res[tag] = {"measured": measured, "formula_bytes": {k: v * N for k, v in formula.items()},
                        "achieved_ratio": ratio}
            del state
    b, c = res["moe"]["measured"], res["concept"]["measured"]
    per_layer_base = b["encoder"]["bytes"] / max(b["encoder"]["layers"], 1)
    per_concept_layer = c["concept"]["bytes"] / max(c["concept"]["layers"], 1)
    R = res["concept"]["achieved_ratio"]
    res["concept_layer_over_baseline_layer"] = per_concept_layer / per_layer_base
    res["target_1_over_R"] = 1 / R
    res["concept_layer_rel_error_vs_1_over_R"] = per_concept_layer / per_layer_base * R - 1
    res["total_ratio"] = c["total_bytes"] / b["total_bytes"]
    res["allocated_total_ratio"] = c["total_allocated_bytes"] / b["total_allocated_bytes"]
    for tag in ("moe", "concept"):
        m, f = res[tag]["measured"], res[tag]["formula_bytes"]
        res[tag]["measured_over_formula"] = {g: (m[g]["bytes"] / f[g] if f[g] else None)
                                             for g in ("encoder", "concept", "decoder")}
        res[tag]["measured_over_formula"]["total"] = m["total_bytes"] / f["total"]
    return res


def predicted(base_cfg, con_cfg, N: int, dtype_bytes: int) -> dict:
    """Accountant: FLOPs/token (a new token attends all N keys: the full-map count is exact here) and a
    batch-1 memory-traffic model (activated weights + the KV cache read per token)."""
    from vlm.flops import count_params, flops_per_token, kv_bytes_per_token
    fb, fc = flops_per_token(base_cfg, N)["total"], flops_per_token(con_cfg, N)["total"]
    def traffic(cfg):
        kv = kv_bytes_per_token(cfg, None, dtype_bytes)["total"] * N
        return count_params(cfg)["activated"] * dtype_bytes + kv
    mb, mc = traffic(base_cfg), traffic(con_cfg)
    return {"flops": fb / fc - 1, "bytes_batch1": mb / mc - 1}


def run(argv=None) -> dict:
    ap = base_parser(NAME, __doc__.split("\n")[0], "KV lengths, e.g. 1K,4K,16K")
    add_pair_args(ap)
    ap.add_argument("--batches", default=None, help="comma list of batch sizes (default 1,8; smoke 1,2)")
    ap.add_argument("--steps", type=int, default=None,
                    help="decode steps per measurement (a multiple of round(R); default 8 CPU, 16 CUDA)")
    ap.add_argument("--fill", choices=("auto", "prefill", "synthetic"), default="auto",
                    help="how the caches reach length N: a real prefill, or synthetic_fill (auto: prefill on CUDA)")
    args = ap.parse_args(argv)
    s = setup(NAME, args, PRESETS, REPS)
    log = logger(s)
    pair = args.pair or ("smoke" if s.preset == "smoke" else ("gpu" if s.is_cuda else "cpu"))
    base_cfg, con_cfg, pair_info = load_pair(pair, args.ratio, args.strategy, seq_len=8192)
    every = max(1, int(round(con_cfg.target_ratio)))
    steps = args.steps or (16 if s.is_cuda else (2 if s.smoke else 8))
    steps = max(every, steps // every * every)  # concept layers run once per `every` steps: count them at that rate
    batches = [int(b) for b in (args.batches or ("1,2" if s.preset == "smoke" else "1,8")).split(",")]
    fill_mode = args.fill if args.fill != "auto" else ("prefill" if s.is_cuda else "synthetic")
    dtype_bytes = torch.empty((), dtype=s.dtype).element_size()
    log(f"baseline: {pair_info['baseline']}")
    log(f"concept:  {pair_info['concept']}")
    log(f"fill={fill_mode}, {steps} steps per measurement, batches {batches}")
    base = build_model(base_cfg, s.device, s.dtype, seed=s.seed)
    con = build_model(con_cfg, s.device, s.dtype, seed=s.seed)
    models = {"moe": base, "concept": con}

    # KV-cache bytes from real caches ------------------------------------------------------------
    bytes_lens = s.sizes if fill_mode == "prefill" else [BYTES_LEN.get(s.preset, min(s.sizes))]
    kv = []
    for N in bytes_lens:
        try:
            kv.append(measure_kv_bytes(base, con, base_cfg, con_cfg, N, s.device, s.dtype))
        except (torch.OutOfMemoryError, MemoryError) as err:
            kv.append({"seq_len": N, "skipped": oom_reason(err)})
        free_memory(s.device)
    log(f"KV bytes measured at {bytes_lens}")

    results, rows = [], []
    counts = {B: count_ops(models, B, base_cfg.vocab_size, s.device, every) for B in batches}
    for B, c in counts.items():
        log(f"B={B}: ops / syncs per step: " + ", ".join(f"{t} {v['ops_per_step']:.0f} / {v['syncs_per_step']:.2f}"
                                                         for t, v in c.items()))

    def report():
        lat_table = md_table(["batch", "KV length", "MoE per step", "ConceptMoE per step", "speedup",
                                "predicted (FLOPs)", "predicted (bytes, B=1)", "tokens/s MoE / ConceptMoE",
                                "ops per step MoE / ConceptMoE", "syncs per step MoE / ConceptMoE",
                                "KV after decode, allocated / held: MoE; ConceptMoE",
                                "concept KV after decode: allocated / held"], rows)
        kv_rows = []
        for r in kv:
            if "skipped" in r:
                kv_rows.append([f"{r['seq_len']:,}", "skipped: " + r["skipped"]] + [""] * 7)
                continue
            b, c = r["moe"], r["concept"]
            for tag, d in (("MoE", b), ("ConceptMoE", c)):
                m, f = d["measured"], d["formula_bytes"]
                cells = []
                for g in ("encoder", "concept", "decoder"):
                    if m[g]["layers"]:
                        cells.append(f"{fmt_num(m[g]['bytes'], 'B')} ({m[g]['layers']} L x "
                                     f"{m[g]['entries_per_layer'][0]:,}) / {fmt_num(f[g], 'B')}")
                    else:
                        cells.append("-")
                con_alloc = (f"{fmt_num(m['concept']['allocated_bytes'], 'B')} / {fmt_num(m['concept']['bytes'], 'B')}"
                             if m["concept"]["layers"] else "-")
                kv_rows.append([f"{r['seq_len']:,}", tag, *cells,
                                f"{fmt_num(m['total_bytes'], 'B')} / {fmt_num(f['total'], 'B')}",
                                fmt_num(m["total_allocated_bytes"], "B"), con_alloc])
            kv_rows.append([f"{r['seq_len']:,}", "ratio", "", f"concept layer / MoE layer = "
                            f"{r['concept_layer_over_baseline_layer']:.4f} (1/R = {r['target_1_over_R']:.4f}, "
                            f"{fmt_pct(r['concept_layer_rel_error_vs_1_over_R'], 2)})", "",
                            f"{r['total_ratio']:.3f}", f"{r['allocated_total_ratio']:.3f}", ""])
        kv_table = md_table(["KV length", "model", "encoder layers: measured / formula",
                               "concept layers: measured / formula", "decoder layers: measured / formula",
                               "total held: measured / formula", "allocated (capacity)",
                               "concept layers: allocated / held"], kv_rows)
        md = (f"## Decode latency per token: ConceptMoE vs matched MoE\n\n{settings_line(s)}\n\n"
              f"- MoE: {pair_info['baseline']}\n- ConceptMoE: {pair_info['concept']}; boundary_mode=fixed (a concept "
              f"every {every} tokens, achieved R exactly {con_cfg.target_ratio:g}; same compute as a learned router "
              "at that R)\n"
              f"- one measurement = {steps} consecutive decode steps (concept model runs on 1 step in {every}); "
              f"latency = per step (a step emits `batch` tokens); caches filled by: {fill_mode}"
              + (" (random K/V at the exact entry counts of a fixed-boundary prefill; see decode.py)"
                 if fill_mode == "synthetic" else "")
              + "\n- speedup = t_MoE / t_ConceptMoE - 1 (median of per-round ratios [IQR]); predicted (FLOPs) = "
              "accountant forward FLOPs/token at KV length N; predicted (bytes) = activated weights + KV read per "
              "token (batch 1)\n\n"
              + lat_table + "\n\n### KV-cache bytes (real prefill, batch 1; `KVCache.nbytes()` of the held entries vs "
              f"`vlm.flops.kv_bytes_per_token` x N; {dtype_bytes}-byte elements)\n\n" + kv_table + "\n\n"
              "'allocated' = the preallocated k/v buffers: token caches hold prompt + new tokens, concept caches "
              "ceil(capacity / R) + 16 slots (`DecodeState.allocate`), grown by 1/16 when a step finds one full "
              "(`generation.grown_capacity`); 'concept KV after decode' = the ConceptMoE's concept caches after "
              "every timed step; 'KV after decode' = every cache of each model after the timed steps; ops = "
              "kernel-launching ATen ops, syncs = host reads of device data, per decode step (mean over "
              f"{max(every, 4 // every * every)} steps after a 16-token prefill; `benchmarks/op_counter.py`)\n")
        targets = speedup_targets(results, "kv_len", TARGETS, "ConceptMoE decode speedup per step over the matched "
                                  "MoE", s.is_cuda)
        if targets:
            md += "\n### Targets (issue 35)\n\n" + targets_md(targets)
        return {"pair": pair_info, "fill": fill_mode, "steps_per_measurement": steps, "batches": batches,
                "results": results, "kv_bytes": kv, "counts": counts, "targets": targets}, md

    # latency -----------------------------------------------------------------------------------
    for B in batches:
        for N in s.sizes:
            cap = N + steps * (s.warmup + s.reps) + every + 2
            try:
                states = {}
                with torch.inference_mode():
                    for tag, m in models.items():
                        states[tag] = m.start_decoding(B, cap)
                        if fill_mode == "prefill":
                            real_fill(m, states[tag], random_ids(B, N, base_cfg.vocab_size, s.device, seed=N + B))
                        else:
                            synthetic_fill(m, states[tag], B, N, seed=N + B)
                tok = random_ids(B, 1, base_cfg.vocab_size, s.device, seed=7)[:, 0]

                def make(tag):
                    m, st = models[tag], states[tag]

                    def fn():
                        for _ in range(steps):
                            m.step(st, tok)
                    return fn
                with torch.inference_mode():
                    comp = interleaved({t: make(t) for t in models}, s.device, s.reps, s.warmup)
            except (torch.OutOfMemoryError, MemoryError) as err:
                log(f"B={B} N={N}: out of memory; skipping the larger lengths")
                results.append({"batch": B, "kv_len": N, "skipped": oom_reason(err)})
                free_memory(s.device)
                break
            concept_entries = [int(c.num_entries().max()) for c in states["concept"].concept_caches]
            concept_kv = {"allocated_bytes": sum(c.k.nbytes + c.v.nbytes for c in states["concept"].concept_caches),
                          "held_bytes": sum(c.nbytes() for c in states["concept"].concept_caches)}
            sp = comp.speedup("moe", "concept")
            pred = predicted(base_cfg, con_cfg, N, dtype_bytes)
            per_tok = {t: comp.stats(t, 1.0 / steps) for t in models}
            res = {"batch": B, "kv_len": N, "steps_per_measurement": steps, "moe_s_per_step": per_tok["moe"],
                   "concept_s_per_step": per_tok["concept"], "speedup": sp, "predicted_speedup_flops": pred["flops"],
                   "predicted_speedup_bytes_batch1": pred["bytes_batch1"],
                   "measured_over_predicted_flops": (sp["median_of_ratios"] / pred["flops"]
                                                     if pred["flops"] > 0 else None),
                   "moe_tokens_per_s": B / per_tok["moe"]["median"],
                   "concept_tokens_per_s": B / per_tok["concept"]["median"],
                   "concept_cache_entries_after": concept_entries, "concept_kv_after": concept_kv,
                   "kv_after": {t: kv_after(states[t]) for t in models}, "counts": counts[B],
                   "fill": fill_mode, "raw_times": comp.times}
            results.append(res)
            m, c = per_tok["moe"], per_tok["concept"]
            rows.append([B, f"{N:,}", fmt_median_iqr(m), fmt_median_iqr(c),
                         f"**{fmt_pct(sp['median_of_ratios'])}** [{fmt_pct(sp['ratio_q1'])}, "
                         f"{fmt_pct(sp['ratio_q3'])}]", fmt_pct(pred["flops"]),
                         fmt_pct(pred["bytes_batch1"]) if B == 1 else "",
                         f"{res['moe_tokens_per_s']:.1f} / {res['concept_tokens_per_s']:.1f}",
                         " / ".join(f"{counts[B][t]['ops_per_step']:,.0f}" for t in models),
                         " / ".join(f"{counts[B][t]['syncs_per_step']:.2f}" for t in models),
                         "; ".join(f"{fmt_num(res['kv_after'][t]['allocated_bytes'], 'B')} / "
                                   f"{fmt_num(res['kv_after'][t]['held_bytes'], 'B')}" for t in models),
                         f"{fmt_num(concept_kv['allocated_bytes'], 'B')} / {fmt_num(concept_kv['held_bytes'], 'B')}"])
            log(f"B={B} N={N}: {fmt_time(m['median'])} vs {fmt_time(c['median'])} per step, speedup "
                f"{fmt_pct(sp['median_of_ratios'])} (predicted FLOPs {fmt_pct(pred['flops'])})")
            states = None
            free_memory(s.device)
            write_results(s, *report(), partial=True)

    def plot(plt):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        ok = [r for r in results if "skipped" not in r]
        for B in batches:
            rs = [r for r in ok if r["batch"] == B]
            if not rs:
                continue
            xs = [r["kv_len"] for r in rs]
            for key, style, label in (("moe_s_per_step", "o-", "MoE"), ("concept_s_per_step", "s--", "ConceptMoE")):
                axes[0].plot(xs, [1e3 * r[key]["median"] for r in rs], style, label=f"{label} B={B}")
            axes[1].plot(xs, [100 * r["speedup"]["median_of_ratios"] for r in rs], "o-", label=f"measured B={B}")
            axes[1].fill_between(xs, [100 * r["speedup"]["ratio_q1"] for r in rs],
                                 [100 * r["speedup"]["ratio_q3"] for r in rs], alpha=0.15)
        if ok:
            xs = sorted({r["kv_len"] for r in ok})
            axes[1].plot(xs, [100 * predicted(base_cfg, con_cfg, N, dtype_bytes)["flops"] for N in xs], "k:",
                         label="predicted (FLOPs)")
        axes[0].set(xscale="log", yscale="log", xlabel="KV length", ylabel="ms per decode step",
                    title=f"decode latency ({s.device.type}, {str(s.dtype).replace('torch.', '')})")
        axes[1].set(xscale="log", xlabel="KV length", ylabel="speedup %", title="ConceptMoE decode speedup")
        axes[1].axhline(0, color="gray", lw=0.5)
        for ax in axes:
            ax.legend(fontsize=8)
        return fig

    return finish(s, report, plot, log)


if __name__ == "__main__":
    run()
