"""Fused kernels vs our torch paths (``train.fused_kernels``), forward + backward, at the 1B preset's shapes.

Per kernel, the torch path and the fused one are two variants of the same interleaved rounds:
  cross_entropy  ``chunked_lm_loss`` vs liger's fused linear CE: head [V, D] + CE over N tokens
  rms_norm       ``rms_norm.RMSNormFn`` vs liger's RMSNorm: [N, D]
  swiglu         ``GroupedSwiGLU`` vs ours with the Triton activation: the experts of one MoE layer,
                 N x top_k rows over E experts (the GEMMs are the same; the difference is the activation)
N = tokens per step (``--sizes``; the GPU MFU step packs ~30K), D / V / E / I / top_k from
configs/model/mfu_1b.yaml. Also the peak memory of one call and the named host syncs per call
(``syncs.host_sync``; none is expected). The verdict per kernel: ``keep`` when the fused
one is faster in the median of per-round ratios; ``auto`` takes a fused kernel only where
``vlm/modeling/gpu_verdicts.json`` marks it correct and faster (written by scripts/gpu/verdicts.py). On CPU the fused kernels cannot run (they are Triton on CUDA): the torch paths are
timed alone (the rehearsal's smoke run).

    python -m benchmarks.fused_kernels --device cuda [--sizes 32768] [--reps 10]
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from benchmarks.cli import base_parser, logger, setup
from benchmarks.harness import free_memory, interleaved, peak_memory_interleaved
from benchmarks.report import finish, fmt_bytes, fmt_median_iqr, md_table, settings_line
from vlm.modeling import fused_kernels as fk
from vlm.modeling import syncs
from vlm.modeling.configuration_conceptmoe import ConceptMoEConfig
from vlm.modeling.modeling_conceptmoe import chunked_lm_loss

NAME = "fused_kernels"
PRESETS = {"smoke": [256], "cpu": [4096], "gpu": [32768]}
REPS = {"smoke": 1, "cpu": 3, "gpu": 10}
PRESET = Path(__file__).resolve().parents[1] / "configs" / "model" / "mfu_1b.yaml"


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_()


def cross_entropy_case(N, c, device, dtype, g):
    head = nn.Linear(c.hidden_size, c.vocab_size, bias=False).to(device, dtype)
    h = _leaf(torch.randn(1, N, c.hidden_size, generator=g).to(device, dtype))
    labels = torch.randint(0, c.vocab_size, (1, N), generator=g)
    labels[:, ::7] = -100  # some positions without a label (prompts, padding)
    labels = labels.to(device)

    def step():
        h.grad = head.weight.grad = None
        chunked_lm_loss(head, h, labels).backward()
    return step


def rms_norm_case(N, c, device, dtype, g):
    x = _leaf(torch.randn(N, c.hidden_size, generator=g).to(device, dtype))
    w = _leaf(torch.rand(c.hidden_size, generator=g).add(0.5).to(device, dtype))
    dy = torch.randn(N, c.hidden_size, generator=g).to(device, dtype)

    def step():
        x.grad = w.grad = None
        fk.rms_norm(x, w, c.rms_norm_eps).backward(dy)
    return step


def swiglu_case(N, c, device, dtype, g):
    E, I, D, S = c.num_experts, c.moe_intermediate_size, c.hidden_size, N * c.top_k
    x = _leaf(torch.randn(S, D, generator=g).to(device, dtype))
    w_gu = _leaf((torch.randn(E, D, 2 * I, generator=g) * D ** -0.5).to(device, dtype))
    w_d = _leaf((torch.randn(E, I, D, generator=g) * I ** -0.5).to(device, dtype))
    rw = _leaf(torch.rand(S, generator=g).to(device, dtype))
    offs = torch.linspace(0, S, E + 1)[1:].round().to(device, torch.int32)
    dy = torch.randn(S, D, generator=g).to(device, dtype)

    def step():
        for t in (x, w_gu, w_d, rw):
            t.grad = None
        fk.IMPL["swiglu"].apply(x, offs, w_gu, w_d, rw).backward(dy)
    return step


CASES = {"cross_entropy": cross_entropy_case, "rms_norm": rms_norm_case, "swiglu": swiglu_case}


def variants_of(kernel: str, step, can_fuse: bool) -> dict:
    def under(name):
        def call():
            with fk.use(**{kernel: name}):
                step()
        return call
    out = {"torch": under("torch")}
    if can_fuse:
        out[fk.FUSED[kernel]] = under(fk.FUSED[kernel])
    return out


def syncs_per_call(fn) -> int:
    with syncs.counting() as seen:
        fn()
    return sum(seen.values())


def run(argv=None) -> dict:
    ap = base_parser(NAME, __doc__.split("\n")[0], "tokens per step N, e.g. 8K,32K")
    ap.add_argument("--kernels", default=",".join(CASES), help="comma list of " + ", ".join(CASES))
    args = ap.parse_args(argv)
    s = setup(NAME, args, PRESETS, REPS)
    log = logger(s)
    c = ConceptMoEConfig.from_yaml(PRESET)
    results = []
    for N in s.sizes:
        for kernel in [k for k in args.kernels.split(",") if k]:
            why = fk.why_not(kernel, s.device.type)
            g = torch.Generator().manual_seed(s.seed)
            variants = variants_of(kernel, CASES[kernel](N, c, s.device, s.dtype, g), why is None)
            log(f"{kernel} N={N}: {list(variants)}" + (f" (fused: {why})" if why else ""))
            comp = interleaved(variants, s.device, s.reps, s.warmup, log=log)
            mem = peak_memory_interleaved(variants, s.device, 2)
            row = {"kernel": kernel, "tokens": N, "fused_name": fk.FUSED[kernel], "fused_unavailable": why,
                   "time_s": {n: comp.stats(n) for n in variants}, "raw_times": comp.times,
                   "peak_bytes": {n: mem[n]["bytes"] for n in variants},
                   "host_syncs_per_call": {n: syncs_per_call(f) for n, f in variants.items()}}
            if why is None:
                row["speedup"] = comp.speedup("torch", fk.FUSED[kernel])
                row["keep"] = row["speedup"]["median_of_ratios"] > 0
            results.append(row)
            variants = None
            free_memory(s.device)

    def report():
        rows = []
        for r in results:
            fused = r["fused_name"]
            t = r["time_s"]
            sp = r.get("speedup")
            rows.append([r["kernel"], f"{r['tokens']:,}", fmt_median_iqr(t["torch"]),
                         fmt_median_iqr(t[fused]) if fused in t else f"n/a ({r['fused_unavailable']})",
                         f"{sp['median_of_ratios'] + 1:.2f}x [{sp['ratio_q1'] + 1:.2f}-{sp['ratio_q3'] + 1:.2f}]"
                         if sp else "n/a",
                         " / ".join(fmt_bytes(r["peak_bytes"].get(n)) for n in ("torch", fused) if n in t),
                         " / ".join(str(r["host_syncs_per_call"][n]) for n in ("torch", fused) if n in t),
                         ("keep" if r["keep"] else "drop (torch path)") if "keep" in r else "n/a"])
        table = md_table(["kernel", "tokens N", "torch fwd+bwd [IQR]", "fused fwd+bwd [IQR]",
                          "torch / fused (per round) [IQR]", "peak memory torch / fused",
                          "named host syncs torch / fused", "verdict"], rows)
        md = (f"## Fused kernels vs the torch paths (train.fused_kernels)\n\n{settings_line(s)}\n\n"
              f"- shapes of configs/model/mfu_1b.yaml: D={c.hidden_size}, V={c.vocab_size}, E={c.num_experts}, "
              f"I={c.moe_intermediate_size}, top_k={c.top_k} (experts: N x top_k rows); forward + backward\n"
              "- verdict: keep where the fused kernel is faster (median of per-round ratios > 1); `auto` takes it "
              "where `vlm/modeling/gpu_verdicts.json` marks it correct and faster (scripts/gpu/verdicts.py)\n\n" + table + "\n")
        return {"results": results, "shapes": {"hidden": c.hidden_size, "vocab": c.vocab_size,
                                               "experts": c.num_experts, "intermediate": c.moe_intermediate_size,
                                               "top_k": c.top_k}}, md

    def plot(plt):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        labels, torch_t, fused_t = [], [], []
        for r in results:
            labels.append(f"{r['kernel']}\nN={r['tokens']:,}")
            torch_t.append(r["time_s"]["torch"]["median"] * 1e3)
            f = r["time_s"].get(r["fused_name"])
            fused_t.append(f["median"] * 1e3 if f else 0.0)
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], torch_t, 0.4, label="torch path")
        ax.bar([x + 0.2 for x in xs], fused_t, 0.4, label="fused")
        ax.set_xticks(list(xs), labels)
        ax.set(ylabel="ms (fwd + bwd)", title=f"fused kernels ({s.device.type}, {str(s.dtype).replace('torch.', '')})")
        ax.legend()
        return fig

    return finish(s, report, plot, log)


if __name__ == "__main__":
    run()
