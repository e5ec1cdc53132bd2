"""Dechunk scaling: ``vlm.modeling.dechunk.dechunk`` (the EMA as one scan) forward + backward vs concepts.

One call = the decoder-side dechunk of one row of M concepts (T = R x M tokens, a boundary every R
tokens): EMA scan over the concepts, the causal read of each token, the STE-weighted residual;
forward and backward (gradients to h, the concepts and the router probabilities). Every size is one
variant of the SAME interleaved rounds, so the per-round ratio largest / smallest is robust to the
machine's slow phases. Target: 16K / 1K concepts <= 20x (linear is 16x). Also the peak memory and the
kernel-launching ATen ops of one call (benchmarks/op_counter.py; a Triton kernel is not an ATen op): the
same at every M and <= 100.

    python -m benchmarks.dechunk [--sizes 1K,2K,4K,8K,16K] [--hidden 128,512] [--smoke]
"""
from __future__ import annotations

import torch

from benchmarks.cli import base_parser, logger, setup
from benchmarks.harness import free_memory, interleaved, peak_memory_interleaved, stats
from benchmarks.op_counter import OpCounter
from benchmarks.report import (
    finish,
    fmt_bytes,
    fmt_median_iqr,
    fmt_ratio,
    md_table,
    settings_line,
)

NAME = "dechunk"
PRESETS = {"smoke": [64, 256], "cpu": [1024, 2048, 4096, 8192, 16384], "gpu": [1024, 2048, 4096, 8192, 16384]}
REPS = {"smoke": 2, "cpu": 7, "gpu": 20}
TARGET_16K_OVER_1K = 20.0
TARGET_OPS = 100  # kernel-launching ATen ops of one forward + backward, at every M


def count_ops(step) -> int:
    with OpCounter() as ops:
        step()
    return ops.total()


def make_inputs(M: int, D: int, R: int, device, dtype, seed: int = 0) -> dict:
    g = torch.Generator(device="cpu").manual_seed(seed)
    T = R * M
    b_BT = (torch.arange(T) % R == 0)[None]
    index_BT = b_BT.long().cumsum(1) - 1
    p_BT = torch.rand(1, T, generator=g).clamp(0.05, 0.95)
    p_BT = torch.where(b_BT, p_BT.clamp(min=0.5), p_BT.clamp(max=0.5))  # consistent with b = p >= 0.5
    h = torch.randn(1, T, D, generator=g)
    c = torch.randn(1, M, D, generator=g)
    grad = torch.randn(1, T, D, generator=g)
    to = dict(device=device)
    return {"h": h.to(**to, dtype=dtype).requires_grad_(), "c": c.to(**to, dtype=dtype).requires_grad_(),
            "p": p_BT.to(**to).requires_grad_(), "b": b_BT.to(**to), "index": index_BT.to(**to),
            "grad": grad.to(**to, dtype=dtype), "T": T}


def step_fn(x: dict, merge: str = "last"):
    from vlm.modeling.dechunk import dechunk

    def step():
        for t in (x["h"], x["c"], x["p"]):
            t.grad = None
        p = x["p"]
        concept_prob = p[x["b"]].view(1, -1)  # the router probability of each concept's boundary token
        z, _ = dechunk(x["h"], x["c"], concept_prob, p, x["b"], x["index"], merge)
        z.backward(x["grad"])
    return step


def run(argv=None) -> dict:
    ap = base_parser(NAME, __doc__.split("\n")[0], "concept counts M, e.g. 1K,4K,16K")
    ap.add_argument("--hidden", default=None,
                    help="model width(s) D, comma list, each its own interleaved rounds (default 128,512: the CPU "
                         "pair's width and a wider one whose 16K rows leave the CPU caches; smoke 32)")
    ap.add_argument("--ratio", type=int, default=2, help="tokens per concept R (T = R x M)")
    args = ap.parse_args(argv)
    s = setup(NAME, args, PRESETS, REPS)
    log = logger(s)
    widths = [int(d) for d in (args.hidden or ("32" if s.preset == "smoke" else "128,512")).split(",") if d.strip()]
    sizes = sorted(s.sizes)
    lo = sizes[0]
    results, targets = [], []
    for D in widths:
        inputs = {M: make_inputs(M, D, args.ratio, s.device, s.dtype, s.seed + M) for M in sizes}
        variants = {f"M={M}": step_fn(inputs[M]) for M in sizes}
        log(f"D={D} R={args.ratio}: {s.warmup} warm-up + {s.reps} rounds over M={sizes}")
        comp = interleaved(variants, s.device, s.reps, s.warmup, log=log)
        mem = peak_memory_interleaved({M: variants[f"M={M}"] for M in sizes}, s.device, 3)
        ops = {M: count_ops(variants[f"M={M}"]) for M in sizes}
        group = []
        for M in sizes:
            per_round = [t / t0 for t, t0 in zip(comp.times[f"M={M}"], comp.times[f"M={lo}"])]
            group.append({"concepts": M, "tokens": inputs[M]["T"], "hidden": D, "time_s": comp.stats(f"M={M}"),
                          "over_smallest": stats(per_round), "linear_over_smallest": M / lo,
                          "peak_bytes": mem[M]["bytes"], "peak_method": mem[M]["method"], "aten_ops": ops[M],
                          "raw_times": comp.times[f"M={M}"]})
        results += group
        applies = (lo, sizes[-1]) == (1024, 16384)
        t = {"hidden": D, "ratio_largest_over_smallest": group[-1]["over_smallest"]["median"],
             "ratio_q1": group[-1]["over_smallest"]["q1"], "ratio_q3": group[-1]["over_smallest"]["q3"],
             "sizes": [lo, sizes[-1]], "target": TARGET_16K_OVER_1K if applies else None}
        t["met"] = (t["ratio_largest_over_smallest"] <= TARGET_16K_OVER_1K) if applies else None
        t["aten_ops"] = [ops[M] for M in sizes]
        t["ops_met"] = len(set(t["aten_ops"])) == 1 and max(t["aten_ops"]) <= TARGET_OPS
        targets.append(t)
        log(f"D={D}: {sizes[-1]} / {lo}: {t['ratio_largest_over_smallest']:.2f}x")
        inputs = variants = None
        free_memory(s.device)

    def report():
        rows = [[r["hidden"], f"{r['concepts']:,}", f"{r['tokens']:,}", fmt_median_iqr(r["time_s"]),
                 fmt_ratio(r["over_smallest"]), f"{r['linear_over_smallest']:.0f}x", fmt_bytes(r["peak_bytes"]),
                 f"{r['aten_ops']:,}"]
                for r in results]
        table = md_table(["D", "concepts M", "tokens T", "fwd+bwd time [IQR]", f"time / M={lo} (per round) [IQR]",
                          "linear would be", "peak memory", "ATen ops"], rows)
        verdicts = "".join(
            f"- D={t['hidden']}: {sizes[-1]:,} / {lo:,} concepts: **{t['ratio_largest_over_smallest']:.1f}x** "
            f"[{t['ratio_q1']:.1f}-{t['ratio_q3']:.1f}]"
            + (f" (target <= {TARGET_16K_OVER_1K:.0f}x: {'met' if t['met'] else 'NOT met'})\n" if t["target"]
               else " (sizes are not 1K..16K: no target)\n")
            + f"  ATen ops per call {' / '.join(f'{n:,}' for n in t['aten_ops'])} (the same at every M, "
              f"<= {TARGET_OPS}: {'met' if t['ops_met'] else 'NOT met'})\n" for t in targets)
        md = (f"## Dechunk scaling: EMA scan forward + backward vs concepts\n\n{settings_line(s)}\n\n"
              f"- `vlm.modeling.dechunk.dechunk` (ema_scan: linear_scan.py, merge=last), batch 1, a boundary every "
              f"{args.ratio} tokens; backward to h, concepts and router probabilities\n"
              f"- per width D, every size is a variant of the same interleaved rounds; 'time / M={lo}' is the "
              f"median of per-round ratios\n" + verdicts +
              f"- peak memory: {results[0]['peak_method']} (median of 3 extra untimed calls per size, the sizes taking turns)\n\n" + table + "\n")
        return {"widths": widths, "ratio": args.ratio, "targets": targets, "results": results}, md

    def plot(plt):
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, D in enumerate(widths):
            grp = [r for r in results if r["hidden"] == D]
            xs = [r["concepts"] for r in grp]
            ax.errorbar(xs, [r["time_s"]["median"] for r in grp],
                        yerr=[[r["time_s"]["median"] - r["time_s"]["q1"] for r in grp],
                              [r["time_s"]["q3"] - r["time_s"]["median"] for r in grp]], marker="o", capsize=3,
                        color=f"C{i}", label=f"dechunk fwd+bwd, D={D}")
            ax.plot(xs, [grp[0]["time_s"]["median"] * x / xs[0] for x in xs], ":", color=f"C{i}", label="linear")
        ax.set(xscale="log", yscale="log", xlabel="concepts M", ylabel="seconds",
               title=f"dechunk scaling ({s.device.type})")
        ax.legend()
        return fig

    return finish(s, report, plot, log)


if __name__ == "__main__":
    run()
