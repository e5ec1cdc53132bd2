"""Training step on packed rows with a learned router: ConceptMoE vs its FLOP-matched plain MoE.

One step = what the trainer runs per micro-batch: the model's forward with labels on packed rows
(``segment_ids`` per document, ``position_ids`` restarting at every document, ``attention_mask``),
the loss (LM + ratio / balance terms), backward. No optimizer step inside the timed call, so the
router, and with it the achieved R, stays the same across the interleaved rounds.

The ConceptMoE is the pair of ``model_pair.load_pair`` (solved by the FLOPs accountant, strategy 1,
R = 2) with ``boundary_mode="dynamic"`` (the learned router, boundary noise in training) - not the
fixed boundaries of prefill.py. Before timing, both models take ``--calib-steps`` AdamW steps on
synthetic packed rows (the router learns from the ratio loss), more (up to ``--calib-max-steps``)
until the eval-mode R is within 10% of the target; if it still is not (on random-token data the small
ratio-loss weight moves R slowly: the CPU pair starts at R ~ 7 with the identity router init and stays
there for 40 steps), ``adjust_router`` blends the router's key projection towards a random one until
it is. The achieved R (eval, and in the timed training steps with boundary noise) is reported, and
beside each speedup the accountant's forward-FLOP prediction for the same rows (``predicted``: the
attention map counted within documents). Peak memory of one step: CUDA max_memory_allocated, CPU
the RSS high-water mark (harness.peak_memory_interleaved).

    python -m benchmarks.train_packed [--sizes 2K,8K,16K] [--doc-len 1024] [--smoke]
"""
from __future__ import annotations

import time

import torch

from benchmarks.cli import base_parser, logger, setup
from benchmarks.harness import free_memory, interleaved, peak_memory_interleaved, stats
from benchmarks.model_pair import add_pair_args, build_model, load_pair, predicted_speedup
from benchmarks.report import (
    finish,
    fmt_bytes,
    fmt_median_iqr,
    fmt_pct,
    fmt_ratio,
    md_table,
    oom_reason,
    settings_line,
    write_results,
)
from vlm.training.metrics import doc_tokens_sq

NAME = "train_packed"
PRESETS = {"smoke": [128, 256], "cpu": [2048, 8192, 16384], "gpu": [2048, 8192, 16384]}
REPS = {"smoke": 2, "cpu": 5, "gpu": 10}
R_TOLERANCE = 0.10  # eval R within 10% of the target


def packed_batch(batch: int, T: int, doc_len: int, vocab: int, device, seed: int = 0) -> dict:
    """``batch`` rows of T tokens, each a run of documents of uniform random length in
    [doc_len / 2, 3 doc_len / 2] (the last one cut at T): segment ids 1..n, positions restarting per
    document, labels = inputs with the first token of every document ignored (-100)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, T), generator=g)
    seg = torch.empty(batch, T, dtype=torch.long)
    pos = torch.empty(batch, T, dtype=torch.long)
    docs = []
    for b in range(batch):
        t, n = 0, 0
        while t < T:
            L = int(torch.randint(max(1, doc_len // 2), max(2, 3 * doc_len // 2 + 1), (1,), generator=g))
            L = min(L, T - t)
            n += 1
            seg[b, t:t + L] = n
            pos[b, t:t + L] = torch.arange(L)
            t += L
        docs.append(n)
    labels = ids.masked_fill(pos == 0, -100)
    to = lambda x: x.to(device)
    return {"input_ids": to(ids), "labels": to(labels), "segment_ids": to(seg), "position_ids": to(pos),
            "attention_mask": to(torch.ones(batch, T, dtype=torch.long)), "docs_per_row": docs}


def predicted(base_cfg, con_cfg, segment_ids_BT: torch.Tensor, ratio: float) -> dict:
    """The accountant's forward-FLOP speedup for these rows at the timed R: attention spans one document,
    so its map is counted at the token-weighted mean document length (sum L^2 / sum L), the causal half
    (what the per-document flash kernels compute) and, for reference, the full map."""
    mean_doc = doc_tokens_sq(segment_ids_BT) / max(int((segment_ids_BT > 0).sum()), 1)
    return {"mean_doc_len": mean_doc,
            "predicted_speedup_causal": predicted_speedup(base_cfg, con_cfg, mean_doc, ratio=ratio, causal_half=True),
            "predicted_speedup_full_map": predicted_speedup(base_cfg, con_cfg, mean_doc, ratio=ratio)}


def model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "docs_per_row"}


@torch.no_grad()
def eval_ratio(model, batch: dict) -> float:
    was = model.training
    model.eval()
    try:
        inputs = model_inputs(batch)
        inputs.pop("labels")
        out = model(**inputs)
        return float(out.compression["ratio"])
    finally:
        model.train(was)


def routers(model) -> list:
    """The boundary routers (modules with the q_proj / k_proj of ``boundary_prob``)."""
    return [m for m in model.modules() if hasattr(m, "query_key") and hasattr(m, "k_proj")]


@torch.no_grad()
def adjust_router(model, probe: dict, target: float, iters: int = 14, seed: int = 0) -> dict:
    """Fallback when training did not bring the eval R within tolerance: blend each router's key
    projection towards a random one, W_k <- (1 - a) W_k + a W_rand (a in [0, 1], bisection on the eval R
    of ``probe``). A random key projection makes cos(q_n, k_{n-1}) ~ 0, p ~ 0.5, R ~ 2 from either side
    (the identity init gives the similarity of adjacent hidden states: usually fewer boundaries)."""
    rs = routers(model)
    g = torch.Generator(device="cpu").manual_seed(seed)
    w0 = [r.k_proj.weight.detach().clone() for r in rs]
    w1 = [(torch.randn(w.shape, generator=g) * w.shape[1] ** -0.5 * float(w.float().norm()) / w.shape[0] ** 0.5
           ).to(w.device, w.dtype) for w in w0]  # float(): the scale is read on the host (a CUDA w)

    def at(a):
        for r, w, wr in zip(rs, w0, w1):
            r.k_proj.weight.copy_((1 - a) * w + a * wr)
        return eval_ratio(model, probe)
    r0, r1 = at(0.0), at(1.0)
    best = min((abs(r0 / target - 1), 0.0), (abs(r1 / target - 1), 1.0))
    lo, hi = 0.0, 1.0
    if (r0 - target) * (r1 - target) < 0:  # bracketed: bisect
        for _ in range(iters):
            mid = (lo + hi) / 2
            r = at(mid)
            best = min(best, (abs(r / target - 1), mid))
            if abs(r / target - 1) <= R_TOLERANCE / 2:
                break
            lo, hi = (mid, hi) if (r - target) * (r0 - target) > 0 else (lo, mid)
    r = at(best[1])
    return {"alpha": best[1], "eval_ratio": r, "eval_ratio_at_0": r0, "eval_ratio_at_1": r1}


def calibrate(models: dict, con_cfg, args, s, log) -> dict:
    """AdamW steps of both models on synthetic packed rows (short), at least ``calib_steps``, then on
    until the ConceptMoE's eval R is within R_TOLERANCE of the target (at most ``calib_max_steps``);
    if it still is not, ``adjust_router``."""
    smoke = s.preset == "smoke"
    T = args.calib_len or (64 if smoke else 256)
    doc_len = max(2, min(args.doc_len or 1024, T // 2))
    vocab = con_cfg.vocab_size
    probe = packed_batch(2, max(T, 512), doc_len, vocab, s.device, seed=s.seed + 99991)
    target = con_cfg.target_ratio
    info = {"target_ratio": target, "calib_len": T, "calib_doc_len": doc_len, "lr": args.calib_lr,
            "eval_ratio_before": eval_ratio(models["concept"], probe), "adjusted": None, "eval_ratio_trace": []}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=args.calib_lr, weight_decay=0.0) for k, m in models.items()}
    t0, steps, losses, r = time.perf_counter(), 0, {k: [] for k in models}, info["eval_ratio_before"]
    while steps < args.calib_max_steps:
        if steps >= args.calib_steps and abs(r / target - 1) <= R_TOLERANCE:
            break
        batch = packed_batch(2, T, doc_len, vocab, s.device, seed=s.seed + 7 * steps + 1)
        for k, m in models.items():
            out = m(**model_inputs(batch))
            out.loss.backward()
            opts[k].step()
            opts[k].zero_grad(set_to_none=True)
            losses[k].append(float(out.loss.detach()))
        steps += 1
        if steps % 10 == 0 or steps >= args.calib_steps:
            r = eval_ratio(models["concept"], probe)
            info["eval_ratio_trace"].append([steps, r])
        if steps % 50 == 0:
            log(f"  calibration step {steps}: eval R {r:.3f}, loss moe {losses['moe'][-1]:.3f} "
                f"concept {losses['concept'][-1]:.3f}")
    r = eval_ratio(models["concept"], probe)
    info.update(steps=steps, seconds=time.perf_counter() - t0, eval_ratio_trained=r,
                loss_first_last={k: [v[0], v[-1]] if v else None for k, v in losses.items()})
    if abs(r / target - 1) > R_TOLERANCE:
        info["adjusted"] = adjust_router(models["concept"], probe, target)
        r = info["adjusted"]["eval_ratio"]
        log(f"  trained eval R {info['eval_ratio_trained']:.3f} outside 10%: router adjusted "
            f"(W_k <- (1 - a) W_k + a W_random, a = {info['adjusted']['alpha']:.3f}) -> eval R {r:.3f}")
    info.update(eval_ratio_after=r, within_tolerance=abs(r / target - 1) <= R_TOLERANCE)
    del opts
    for m in models.values():
        m.zero_grad(set_to_none=True)
    return info


def run(argv=None) -> dict:
    ap = base_parser(NAME, __doc__.split("\n")[0], "packed tokens per row, e.g. 2K,8K,16K")
    add_pair_args(ap)
    ap.add_argument("--batch", type=int, default=1, help="packed rows per step (default 1)")
    ap.add_argument("--doc-len", type=int, default=None, help="mean document length (default 1024; smoke 32)")
    ap.add_argument("--boundary-mode", choices=("dynamic", "fixed"), default="dynamic",
                    help="dynamic (default): the learned router as in training; fixed: a boundary every R tokens")
    ap.add_argument("--calib-steps", type=int, default=None, help="AdamW steps before timing (default CPU 30, CUDA 200; smoke 3)")
    ap.add_argument("--calib-max-steps", type=int, default=None,
                    help="more steps until eval R is within 10%% of the target (default CPU 60, CUDA 400; smoke 10)")
    ap.add_argument("--calib-len", type=int, default=None, help="tokens per calibration row (default 256; smoke 64)")
    ap.add_argument("--calib-lr", type=float, default=3e-4)
    ap.add_argument("--mem-reps", type=int, default=1, help="peak-memory calls per model and size (median)")
    args = ap.parse_args(argv)
    s = setup(NAME, args, PRESETS, REPS)
    log = logger(s)
    smoke = s.preset == "smoke"
    args.calib_steps = args.calib_steps if args.calib_steps is not None else (3 if smoke else (200 if s.is_cuda else 30))
    args.calib_max_steps = max(args.calib_steps, args.calib_max_steps if args.calib_max_steps is not None
                               else (10 if smoke else (400 if s.is_cuda else 60)))
    doc_len = args.doc_len or (32 if smoke else 1024)
    pair = args.pair or ("smoke" if smoke else ("gpu" if s.is_cuda else "cpu"))
    base_cfg, con_cfg, pair_info = load_pair(pair, args.ratio, args.strategy, seq_len=max(s.sizes),
                                               boundary_mode=args.boundary_mode)
    log(f"MoE: {pair_info['baseline']}")
    log(f"ConceptMoE: {pair_info['concept']} (boundary_mode={con_cfg.boundary_mode}, noise tau "
        f"{con_cfg.boundary_noise_tau})")
    models = {"moe": build_model(base_cfg, s.device, s.dtype, seed=s.seed, train=True),
              "concept": build_model(con_cfg, s.device, s.dtype, seed=s.seed, train=True)}
    calib = calibrate(models, con_cfg, args, s, log)
    log(f"router calibration: {calib['steps']} AdamW steps ({calib['seconds']:.0f} s), eval R "
        f"{calib['eval_ratio_before']:.3f} -> {calib['eval_ratio_trained']:.3f}"
        + (" -> adjusted" if calib["adjusted"] else "")
        + f" -> {calib['eval_ratio_after']:.3f} (target {calib['target_ratio']})")
    results, rows = [], []

    def report():
        table = md_table(["packed T", "rows x docs", "model", "fwd+bwd step [IQR]", "tokens/s",
                          "ConceptMoE / MoE time (per round) [IQR]", "peak memory", "ConceptMoE / MoE memory",
                          "R train (eval)"], rows)
        ok = [r for r in results if "skipped" not in r]
        md = (f"## Training step on packed rows, learned router: ConceptMoE vs matched MoE (forward + backward)"
              f"\n\n{settings_line(s)}\n\n"
              f"- MoE: {pair_info['baseline']} ({pair_info['baseline_config']})\n"
              f"- ConceptMoE: {pair_info['concept']}; boundary_mode={con_cfg.boundary_mode} (boundary noise tau "
              f"{con_cfg.boundary_noise_tau} in the timed training steps); matched by the accountant: params "
              f"{pair_info['param_diff']:+.2%}, forward FLOPs/token w/o attention map "
              f"{pair_info['flop_diff_no_attn_map']:+.2%}\n"
              f"- step = forward with labels on {args.batch} packed row(s) (segment_ids, position_ids restarting "
              f"per document, documents of {doc_len // 2}..{3 * doc_len // 2} tokens), loss, backward; no "
              f"optimizer step (the router stays fixed while timed)\n"
              f"- router state: {calib['steps']} AdamW steps (lr {calib['lr']}) of both models on synthetic packed "
              f"rows of {calib['calib_len']} tokens; eval R {calib['eval_ratio_before']:.3f} at init -> "
              f"{calib['eval_ratio_trained']:.3f} trained"
              + (f" -> adjusted (W_k <- (1 - a) W_k + a W_random, a = {calib['adjusted']['alpha']:.3f})"
                 if calib["adjusted"] else "")
              + f" -> **{calib['eval_ratio_after']:.3f}** (target {calib['target_ratio']}, within 10%: "
              f"{'yes' if calib['within_tolerance'] else 'NO'})\n"
              f"- peak memory: {ok[0]['peak_method'] if ok else 'n/a'}, median of {args.mem_reps} extra untimed step(s) "
              f"per model, the models taking turns (CPU: the RSS mark varies ~+-20% call to call; raise --mem-reps)\n"
              + "".join(f"- T={r['seq_len']:,}: ConceptMoE step speedup **{fmt_pct(r['speedup']['median_of_ratios'])}**"
                        f" [{fmt_pct(r['speedup']['ratio_q1'])}, {fmt_pct(r['speedup']['ratio_q3'])}]; the "
                        f"accountant's forward-FLOP prediction {fmt_pct(r['predicted_speedup_causal'])} (causal "
                        f"attention within documents of token-weighted mean length {r['mean_doc_len']:,.0f}); R in "
                        f"the timed steps {r['achieved_ratio_train']:.3f}, eval R {r['achieved_ratio_eval']:.3f}\n"
                        for r in ok)
              + "".join(f"- T={r['seq_len']:,}: {r['skipped']}\n" for r in results if "skipped" in r)
              + "\n" + table + "\n")
        return {"pair": pair_info, "batch": args.batch, "doc_len": doc_len, "calibration": calib,
                "boundary_mode": con_cfg.boundary_mode, "results": results}, md

    for T in s.sizes:
        batch = packed_batch(args.batch, T, doc_len, base_cfg.vocab_size, s.device, seed=s.seed + T)
        inputs = model_inputs(batch)
        ratios, losses = [], {k: [] for k in models}

        def make(tag):
            m = models[tag]

            def step():
                m.zero_grad(set_to_none=True)
                out = m(**inputs)
                out.loss.backward()
                losses[tag].append(float(out.loss.detach()))
                if out.compression is not None:
                    ratios.append(float(out.compression["ratio"]))
            return step
        variants = {"moe": make("moe"), "concept": make("concept")}
        log(f"T={T} x {args.batch} ({batch['docs_per_row']} documents): {s.warmup} warm-up + {s.reps} rounds")
        try:
            comp = interleaved(variants, s.device, s.reps, s.warmup, log=log)
            mem = peak_memory_interleaved(variants, s.device, args.mem_reps)
            r_eval = eval_ratio(models["concept"], batch)
        except (torch.OutOfMemoryError, MemoryError) as err:
            results.append({"seq_len": T, "batch": args.batch, "skipped": oom_reason(err)})
            free_memory(s.device)
            break
        for m in models.values():
            m.zero_grad(set_to_none=True)
        per_round = [c / b for c, b in zip(comp.times["concept"], comp.times["moe"])]
        res = {"seq_len": T, "batch": args.batch, "tokens_per_step": args.batch * T,
               "docs_per_row": batch["docs_per_row"], "speedup": comp.speedup("moe", "concept"),
               "concept_over_moe_time": stats(per_round),
               "concept_over_moe_memory": mem["concept"]["bytes"] / mem["moe"]["bytes"] if mem["moe"]["bytes"] else None,
               "achieved_ratio_train": sum(ratios) / len(ratios), "achieved_ratio_train_min": min(ratios),
               "achieved_ratio_train_max": max(ratios), "achieved_ratio_eval": r_eval,
               "peak_method": mem["moe"]["method"], "raw_times": comp.times}
        res.update(predicted(base_cfg, con_cfg, batch["segment_ids"], res["achieved_ratio_train"]))
        for tag in models:
            st = comp.stats(tag)
            res[tag] = {"step_s": st, "tokens_per_s": args.batch * T / st["median"],
                        "peak_bytes": mem[tag]["bytes"], "peak_samples": mem[tag]["samples"], "loss_first_last": [losses[tag][0], losses[tag][-1]]}
        results.append(res)
        for tag in models:
            c = tag == "concept"
            rows.append([f"{T:,}", f"{args.batch} x {batch['docs_per_row']}", "ConceptMoE" if c else "MoE",
                         fmt_median_iqr(res[tag]["step_s"]), f"{res[tag]['tokens_per_s']:,.0f}",
                         f"**{fmt_ratio(res['concept_over_moe_time'])}**" if c else "",
                         fmt_bytes(res[tag]["peak_bytes"]),
                         (f"{res['concept_over_moe_memory']:.2f}x" if res["concept_over_moe_memory"] else "n/a")
                         if c else "",
                         f"{res['achieved_ratio_train']:.3f} ({r_eval:.3f})" if c else ""])
        log(f"T={T}: MoE {res['moe']['tokens_per_s']:,.0f} tok/s, ConceptMoE {res['concept']['tokens_per_s']:,.0f} "
            f"tok/s, time ratio {res['concept_over_moe_time']['median']:.3f}x, memory ratio "
            f"{res['concept_over_moe_memory'] or float('nan'):.2f}x, R train {res['achieved_ratio_train']:.3f} "
            f"eval {r_eval:.3f}; predicted speedup {fmt_pct(res['predicted_speedup_causal'])} (mean document "
            f"{res['mean_doc_len']:,.0f} tokens)")
        inputs = batch = variants = None
        free_memory(s.device)
        write_results(s, *report(), partial=True)

    def plot(plt):
        ok = [r for r in results if "skipped" not in r]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        xs = [r["seq_len"] for r in ok]
        for tag, label in (("moe", "MoE"), ("concept", "ConceptMoE")):
            a1.plot(xs, [r[tag]["tokens_per_s"] for r in ok], "o-", label=label)
            a2.plot(xs, [r[tag]["peak_bytes"] / 2**20 for r in ok], "o-", label=label)
        a1.set(xscale="log", xlabel="packed tokens", ylabel="tokens / s (fwd+bwd)",
               title=f"packed training step ({s.device.type}, learned router)")
        a2.set(xscale="log", xlabel="packed tokens", ylabel="peak MiB", title="peak memory of one step")
        for ax in (a1, a2):
            ax.legend()
        return fig

    return finish(s, report, plot, log)


if __name__ == "__main__":
    run()
