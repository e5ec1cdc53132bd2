"""MoE layer: our ``MoEFeedForward`` vs transformers' own MoE block, and vs the matmul peak.

Same shape, weights, tokens and routing; every variant and a large square matmul are timed in the
same interleaved rounds (forward, and forward + backward); outputs are checked against ours.

    python -m benchmarks.moe [--device cuda --dtype bfloat16] [--sizes 256,4096] [--smoke]
"""
from __future__ import annotations


import torch

from benchmarks.cli import base_parser, logger, setup
from benchmarks.harness import free_memory, interleaved, make_matmul, matmul_peak_size
from benchmarks.report import finish, fmt_median_iqr, fmt_num, md_table, settings_line, write_results

NAME = "moe"
PRESETS = {"smoke": [32, 128], "cpu": [32, 256, 2048], "gpu": [64, 1024, 16384]}
REPS = {"smoke": 1, "cpu": 5, "gpu": 7}
SHAPES = {"smoke": dict(hidden=32, experts=4, top_k=2, inter=32),
          "cpu": dict(hidden=256, experts=16, top_k=4, inter=512),
          "gpu": dict(hidden=2048, experts=64, top_k=8, inter=768)}  # the GPU pair's MoE layer
PORTABLE_HF = ("eager", "grouped_mm", "batched_mm")


def build_ours(shape: dict, dispatch: str, device, dtype, seed: int = 0):
    from vlm.modeling.configuration_conceptmoe import MoEConfig
    from vlm.modeling.moe import MoEFeedForward, init_moe_weights
    torch.manual_seed(seed)
    m = MoEFeedForward(shape["hidden"], MoEConfig(num_experts=shape["experts"], top_k=shape["top_k"],
                                                  moe_intermediate_size=shape["inter"], moe_dispatch=dispatch))
    init_moe_weights(m, std=0.02)
    torch.nn.init.normal_(m.router.weight, std=0.5 / shape["hidden"] ** 0.5)  # spread routing, like a trained router
    return m.to(device, dtype)


def build_hf(shape: dict, impl: str, ours, device, dtype):
    """transformers' Qwen3-MoE sparse block of the same shape, holding a copy of ``ours``'s weights.

    ``impl`` is set the documented way, ``config._experts_implementation``: ``eager`` (per-expert
    loop), ``grouped_mm``, ``batched_mm`` (a weight copy per (token, expert) pair; skipped above
    ``--batched-mm-cap-gb``); ``deepgemm`` / ``sonicmoe`` need hub kernels and are tried only when named.
    """
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    cfg = Qwen3MoeConfig(hidden_size=shape["hidden"], moe_intermediate_size=shape["inter"],
                         num_experts=shape["experts"], num_experts_per_tok=shape["top_k"], norm_topk_prob=True,
                         hidden_act="silu")
    cfg._experts_implementation = impl
    blk = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        # ours: w_gate_up [E, D, 2I], w_down [E, I, D]; HF: gate_up_proj [E, 2I, D], down_proj [E, D, I]
        blk.experts.gate_up_proj.copy_(ours.w_gate_up.transpose(1, 2).float())
        blk.experts.down_proj.copy_(ours.w_down.transpose(1, 2).float())
        blk.gate.weight.copy_(ours.router.weight.float())
    return blk.to(device, dtype)


def run(argv=None) -> dict:
    ap = base_parser(NAME, __doc__.split("\n")[0], "token counts per call, e.g. 256,2048")
    ap.add_argument("--shape", default=None, help="smoke | cpu | gpu or hidden,experts,top_k,inter (default by preset)")
    ap.add_argument("--hf-impls", default=",".join(PORTABLE_HF),
                    help="transformers experts implementations to try "
                         "(eager,grouped_mm,batched_mm[,deepgemm,sonicmoe])")
    ap.add_argument("--batched-mm-cap-gb", type=float, default=None,
                    help="skip batched_mm when its per-pair weight copies exceed this (default 1.5 CPU, 20 CUDA)")
    ap.add_argument("--no-backward", action="store_true", help="forward only")
    args = ap.parse_args(argv)
    s = setup(NAME, args, PRESETS, REPS)
    log = logger(s)
    key = args.shape or ("smoke" if s.preset == "smoke" else ("gpu" if s.is_cuda else "cpu"))
    if key in SHAPES:
        shape = dict(SHAPES[key])
    else:
        d, e, k, i = (int(v) for v in key.split(","))
        shape = dict(hidden=d, experts=e, top_k=k, inter=i)
    D, E, K, I = shape["hidden"], shape["experts"], shape["top_k"], shape["inter"]  # noqa: E741
    cap_gb = args.batched_mm_cap_gb or (20.0 if s.is_cuda else 1.5)
    elem = torch.empty((), dtype=s.dtype).element_size()
    log(f"shape: hidden {D}, {E} experts, top-{K}, expert width {I}; {s.dtype}")

    ours = {"ours_sorted": build_ours(shape, "sorted", s.device, s.dtype, s.seed)}
    ours["ours_loop"] = build_ours(shape, "loop", s.device, s.dtype, s.seed)
    ref = ours["ours_sorted"]
    hf, unavailable = {}, {}
    for impl in [x.strip() for x in args.hf_impls.split(",") if x.strip()]:
        try:
            blk = build_hf(shape, impl, ref, s.device, s.dtype)
            probe = torch.randn(1, 8, D, device=s.device, dtype=s.dtype, requires_grad=True)
            blk(probe).float().sum().backward()  # does it run here, forward and backward?
            blk.zero_grad(set_to_none=True)
            hf[f"hf_{impl}"] = blk
        except Exception as err:  # noqa: BLE001 - recorded, not hidden
            unavailable[f"hf_{impl}"] = f"{err.__class__.__name__}: {str(err).splitlines()[0][:200]}"
            log(f"hf_{impl}: unavailable here ({unavailable[f'hf_{impl}']})")
    peak_n = matmul_peak_size(s.device, s.dtype, s.smoke)
    peak_fn, peak_flops = make_matmul(s.device, s.dtype, peak_n)

    def report():
        table = md_table(["tokens", "pass", "variant", "time [IQR]", "tokens/s", "expert FLOP/s", "of peak",
                            "time vs ours_sorted", "max abs diff vs ours"], rows)
        md = (f"## MoE layer: ours vs transformers (Qwen3-MoE sparse block), {D} hidden, {E} experts, top-{K}, "
              f"expert width {I}\n\n{settings_line(s)}\n\n"
              "- ours_sorted = `MoEFeedForward(moe_dispatch=\"sorted\")` (CUDA bf16: `torch._grouped_mm`; else a "
              "per-expert loop over contiguous sorted segments); ours_loop = the per-expert masked reference\n"
              "- hf_* = `transformers.models.qwen3_moe.Qwen3MoeSparseMoeBlock` with `config._experts_implementation` "
              "= eager / grouped_mm / batched_mm, the same weights (max abs diff column)\n"
              "- expert FLOP/s = active-expert FLOPs (forward 6·T·k·d·I, forward+backward 3x) / median time; "
              "'of peak' divides by the median rate of a square matmul timed in the same interleaved rounds\n\n"
              + table + "\n")
        return {"shape": shape, "hf_unavailable": unavailable, "results": results}, md

    results, rows = [], []
    modes = ["forward"] + ([] if args.no_backward else ["forward+backward"])
    for T in s.sizes:
        g = torch.Generator(device="cpu").manual_seed(s.seed + T)
        x = torch.randn(1, T, D, generator=g).to(s.device, s.dtype)
        grad_out = torch.randn(1, T, D, generator=g).to(s.device, s.dtype)
        mods = {**ours, **hf}
        skipped = dict(unavailable)
        if "hf_batched_mm" in mods:
            need = T * K * 3 * I * D * elem * 2 / 2**30  # weight copies + their gradients / workspace
            if need > cap_gb:
                skipped["hf_batched_mm"] = (f"skipped: materialises a weight copy per (token, expert) pair, "
                                            f"~{need:.1f} GB at {T} tokens (> cap {cap_gb:g} GB)")
                mods.pop("hf_batched_mm")
        # correctness: every variant against ours_sorted on this input
        with torch.no_grad():
            y_ref = ref(x)[0].float()
            check = {}
            for name, m in mods.items():
                y = m(x)
                y = (y[0] if isinstance(y, tuple) else y).float()
                check[name] = float((y - y_ref).abs().max())
        flops_fwd = 6.0 * T * K * D * I
        entry = {"tokens": T, "max_abs_diff_vs_ours": check, "skipped": skipped, "flops_forward": flops_fwd}
        for mode in modes:
            variants = {}
            for name, m in mods.items():
                if mode == "forward":
                    def fn(m=m):
                        with torch.no_grad():
                            return m(x)
                else:
                    xg = x.detach().clone().requires_grad_(True)

                    def fn(m=m, xg=xg):
                        for p in m.parameters():
                            p.grad = None
                        xg.grad = None
                        y = m(xg)
                        (y[0] if isinstance(y, tuple) else y).backward(grad_out)
                variants[name] = fn
            variants["matmul_peak"] = peak_fn
            inner = 1 if not s.is_cuda else 5
            log(f"T={T} {mode}: {len(variants)} variants, {s.warmup} warm-up + {s.reps} rounds")
            comp = interleaved(variants, s.device, s.reps, s.warmup, inner=inner)
            peak_rate = peak_flops / comp.median("matmul_peak")
            flops = flops_fwd * (1 if mode == "forward" else 3)
            per = {}
            for name in variants:
                if name == "matmul_peak":
                    continue
                st = comp.stats(name)
                rate = flops / st["median"]
                per[name] = {"seconds": st, "tokens_per_s": T / st["median"], "expert_flops_per_s": rate,
                             "fraction_of_peak": rate / peak_rate,
                             "vs_ours_sorted": comp.median(name) / comp.median("ours_sorted")}
            hf_names = [n for n in per if n.startswith("hf_")]
            fastest_hf = min(hf_names, key=lambda n: per[n]["seconds"]["median"]) if hf_names else None
            entry[mode] = {"peak_flops_per_s": peak_rate, "peak_matmul_n": peak_n, "variants": per,
                           "fastest_hf": fastest_hf,
                           "ours_vs_fastest_hf_speedup": (comp.speedup(fastest_hf, "ours_sorted")
                                                          if fastest_hf else None),
                           "raw_times": comp.times}
            for name, r in per.items():
                rows.append([f"{T:,}", mode, name, fmt_median_iqr(r["seconds"]),
                             f"{r['tokens_per_s']:,.0f}", fmt_num(r["expert_flops_per_s"], "FLOP/s"),
                             f"{r['fraction_of_peak']:.0%}", f"{r['vs_ours_sorted']:.2f}x",
                             f"{check.get(name, 0.0):.1e}"])
            for name, why in skipped.items():
                rows.append([f"{T:,}", mode, name, why, "", "", "", "", ""])
            rows.append([f"{T:,}", mode, "matmul peak", f"{peak_n}^3 matmul", "", fmt_num(peak_rate, "FLOP/s"),
                         "100%", "", ""])
            log(f"T={T} {mode}: ours_sorted {per['ours_sorted']['fraction_of_peak']:.0%} of peak "
                f"({fmt_num(peak_rate, 'FLOP/s')}); fastest HF {fastest_hf} "
                + (f"{per[fastest_hf]['vs_ours_sorted']:.2f}x our time" if fastest_hf else ""))
        results.append(entry)
        free_memory(s.device)
        write_results(s, *report(), partial=True)

    def plot(plt):
        fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
        for ax, mode in zip(axes[0], modes):
            names = sorted({n for r in results for n in r[mode]["variants"]})
            width = 0.8 / max(len(results), 1)
            for i, r in enumerate(results):
                vals = [100 * r[mode]["variants"][n]["fraction_of_peak"] if n in r[mode]["variants"] else 0
                        for n in names]
                ax.bar([j + i * width for j in range(len(names))], vals, width, label=f"{r['tokens']} tokens")
            ax.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(names))], names, rotation=30,
                          ha="right", fontsize=8)
            ax.set(ylabel="% of measured matmul peak", title=f"MoE {mode} ({s.device.type}, "
                                                              f"{str(s.dtype).replace('torch.', '')})")
            ax.legend(fontsize=8)
        return fig

    return finish(s, report, plot, log)


if __name__ == "__main__":
    run()
