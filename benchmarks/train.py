"""Training throughput and MFU: ConceptMoE vs its matched plain MoE (default: the ``small`` presets).

One step = forward with labels, backward, AdamW step; both models and a square matmul (the peak
that MFU divides by) are timed in the same interleaved rounds. bf16 (the CUDA default) keeps the
weights, activations and AdamW states in bf16.

    python -m benchmarks.train [--device cuda] [--sizes 256] [--batch 2] [--smoke]
"""
from __future__ import annotations


import torch

from benchmarks import ROOT
from benchmarks.cli import base_parser, logger, setup
from benchmarks.harness import free_memory, interleaved, make_matmul, matmul_peak_size
from benchmarks.model_pair import add_pair_args, build_model, load_pair, random_ids
from benchmarks.report import (
    finish, fmt_median_iqr, fmt_num, fmt_pct, md_table, oom_reason, settings_line, write_results,
)

NAME = "train"
PRESETS = {"smoke": [32], "cpu": [256], "gpu": [2048]}
REPS = {"smoke": 1, "cpu": 3, "gpu": 10}
SMALL = (ROOT / "configs" / "model" / "small.yaml", ROOT / "configs" / "model" / "small_concept.yaml")


def default_pair(preset: str) -> str:
    if preset == "smoke":
        return "smoke"
    if SMALL[0].is_file():
        return f"{SMALL[0]}:{SMALL[1]}" if SMALL[1].is_file() else str(SMALL[0])
    return "cpu"


def run(argv=None) -> dict:
    ap = base_parser(NAME, __doc__.split("\n")[0], "sequence lengths (rows of --batch), e.g. 256,512")
    add_pair_args(ap)
    ap.add_argument("--batch", type=int, default=None, help="rows per step (default 2 CPU, 16 CUDA, 2 smoke)")
    ap.add_argument("--boundary-mode", choices=("fixed", "dynamic"), default="fixed",
                    help="fixed: a boundary every round(R) tokens; dynamic: the learned router with boundary noise")
    ap.add_argument("--lr", type=float, default=1e-4)
    args = ap.parse_args(argv)
    s = setup(NAME, args, PRESETS, REPS)
    log = logger(s)
    pair = args.pair or default_pair(s.preset)
    batch = args.batch or (16 if s.is_cuda and s.preset != "smoke" else 2)
    from vlm.flops import flops_per_token
    results, rows = [], []
    base_cfg, con_cfg, pair_info = load_pair(pair, args.ratio, args.strategy, seq_len=max(s.sizes),
                                               boundary_mode=args.boundary_mode)
    log(f"MoE: {pair_info['baseline']}")
    log(f"ConceptMoE: {pair_info['concept']} ({args.boundary_mode} boundaries)")
    models = {"moe": build_model(base_cfg, s.device, s.dtype, seed=s.seed, train=True),
              "concept": build_model(con_cfg, s.device, s.dtype, seed=s.seed, train=True)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.0) for k, m in models.items()}
    peak_fn, peak_flops = make_matmul(s.device, s.dtype, matmul_peak_size(s.device, s.dtype, s.smoke))

    def report():
        table = md_table(["seq len", "batch", "model", "step time [IQR]", "tokens/s", "train FLOPs/token",
                            "model FLOP/s", "matmul peak", "MFU", "MFU (causal map)"], rows)
        sp = [r for r in results if "skipped" not in r]
        md = ("## Training throughput and MFU (AdamW, forward + backward + step)"
              + f"\n\n{settings_line(s)}\n\n"
              f"- MoE: {pair_info['baseline']} ({pair_info['baseline_config']})\n- ConceptMoE: {pair_info['concept']} "
              f"({pair_info.get('concept_config', 'solved by the accountant')}); boundary_mode={args.boundary_mode}"
              + (f"; achieved R {sp[0]['achieved_ratio']:.3f}" if sp else "") + "\n"
              "- MFU = accountant training FLOPs/token (3 x forward, full attention map) x tokens/s / the fp32 "
              "(or --dtype) "
              "matmul peak measured in the same interleaved rounds; 'causal map' counts half the attention map\n"
              + "".join(f"- T={r['seq_len']}: ConceptMoE step speedup {fmt_pct(r['speedup']['median_of_ratios'])}\n"
                        for r in sp) + "\n" + table + "\n")
        return {"pair": pair_info, "batch": batch, "boundary_mode": args.boundary_mode, "results": results}, md

    for T in s.sizes:
        ids = random_ids(batch, T, base_cfg.vocab_size, s.device, seed=s.seed + T)
        ratios = []
        losses = {k: [] for k in models}

        def make(tag):
            m, opt = models[tag], opts[tag]

            def step():
                out = m(input_ids=ids, labels=ids)
                out.loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses[tag].append(float(out.loss.detach()))
                if out.compression is not None:
                    ratios.append(float(out.compression["ratio"]))
            return step
        log(f"T={T} batch={batch}: {s.warmup} warm-up + {s.reps} rounds")
        try:
            comp = interleaved({"moe": make("moe"), "concept": make("concept"), "matmul_peak": peak_fn},
                                 s.device, s.reps, s.warmup, log=log)
        except (torch.OutOfMemoryError, MemoryError) as err:
            why = oom_reason(err)
            results.append({"seq_len": T, "batch": batch, "skipped": why})
            free_memory(s.device)
            break
        ratio = sum(ratios) / len(ratios)
        peak = peak_flops / comp.median("matmul_peak")
        res = {"seq_len": T, "batch": batch, "tokens_per_step": batch * T, "peak_flops_per_s": peak,
               "achieved_ratio": ratio, "speedup": comp.speedup("moe", "concept"), "raw_times": comp.times}
        for tag, cfg in (("moe", base_cfg), ("concept", con_cfg)):
            st = comp.stats(tag)
            f = flops_per_token(cfg, T, ratio=ratio if cfg.chunking else None)
            fc = flops_per_token(cfg, T, ratio=ratio if cfg.chunking else None, causal_half=True)
            tps = batch * T / st["median"]
            res[tag] = {"step_s": st, "tokens_per_s": tps, "train_flops_per_token": f["train_total"],
                        "train_flops_per_token_causal": fc["train_total"],
                        "model_flops_per_s": f["train_total"] * tps, "mfu": f["train_total"] * tps / peak,
                        "mfu_causal": fc["train_total"] * tps / peak,
                        "loss_first_last": [losses[tag][0], losses[tag][-1]]}
            if s.is_cuda:
                from vlm.training.peak import gpu_spec_peak
                res[tag]["mfu_vs_spec_sheet"] = f["train_total"] * tps / gpu_spec_peak()[0]
            rows.append([f"{T:,}", batch, "MoE" if tag == "moe" else "ConceptMoE",
                         fmt_median_iqr(st),
                         f"{tps:,.0f}", fmt_num(f["train_total"]), fmt_num(f["train_total"] * tps, "FLOP/s"),
                         fmt_num(peak, "FLOP/s"), f"**{res[tag]['mfu']:.1%}**", f"{res[tag]['mfu_causal']:.1%}"])
        results.append(res)
        log(f"T={T}: MoE {res['moe']['tokens_per_s']:,.0f} tok/s MFU {res['moe']['mfu']:.1%}; ConceptMoE "
            f"{res['concept']['tokens_per_s']:,.0f} tok/s MFU {res['concept']['mfu']:.1%}; ratio {ratio:.3f}")
        free_memory(s.device)
        write_results(s, *report(), partial=True)
    def plot(plt):
        sp = [r for r in results if "skipped" not in r]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        labels = [f"{tag} T={r['seq_len']}" for r in sp for tag in ("moe", "concept")]
        a1.bar(labels, [r[tag]["tokens_per_s"] for r in sp for tag in ("moe", "concept")], color=["C0", "C1"] * len(sp))
        a1.set(ylabel="tokens / s", title=f"training throughput ({s.device.type}, batch {batch})")
        a2.bar(labels, [100 * r[tag]["mfu"] for r in sp for tag in ("moe", "concept")], color=["C0", "C1"] * len(sp))
        a2.axhline(30, color="red", ls="--", lw=1, label="target 30%")
        a2.set(ylabel="MFU % of measured matmul peak", title="MFU")
        a2.legend()
        for ax in (a1, a2):
            ax.tick_params(axis="x", labelrotation=20)
        return fig

    return finish(s, report, plot, log)


if __name__ == "__main__":
    run()
