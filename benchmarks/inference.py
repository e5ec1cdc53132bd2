"""Which to pick for inference: our plain MoE vs transformers' Qwen3-MoE on the same imported weights,
transformers with ``StaticCache`` eager and ``StaticCache`` + ``torch.compile`` (``get_compiled_call``
with its default ``CompileConfig``: the compiled forward its ``generate`` uses for the decode steps of a
static cache, the prefill running eager; ``--compile-prefill`` compiles the prefill too, one compile per
prompt shape), and the R = 2 ConceptMoE converted from the same weights (``vlm.convert``, boundaries
fixed at R = 2).

Per mode: prefill time per prompt length (fresh caches), decode time per step at batch 1 and 8 at
each KV length (continuing the prefill's cache), kernel-launching ops and host syncs per decode step
(``benchmarks/op_counter.py``; eager modes: a compiled graph runs fused kernels the dispatcher does not
see), and allocated / held KV bytes. Ratios are to transformers' compiled path, median of per-round
ratios from the same interleaved rounds. Issue 35's targets, met or missed, are computed from these.

Modes (``benchmarks/inference_modes.py``'s ``MODES``; ``--modes`` picks): each is a ``Mode`` (start a
cache, prefill, one decode step, KV bytes); ours also with its decode compiled (``decode="compiled"``) and,
on CUDA, captured as CUDA graphs (``"cudagraph"``); every table takes its rows from the modes that ran.

    python -m benchmarks.inference [--device cuda] [--sizes 1K,8K,32K] [--decode-sizes 1K,8K] [--batches 1,8]
        [--modes ours,ours_compiled,ours_R2,hf_static,hf_static_compiled] [--smoke]
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from benchmarks.cli import base_parser, logger, parse_sizes, setup
from benchmarks.harness import free_memory, interleaved, sync
from benchmarks.hf_pair import SHAPES, build_hf, load_hf, load_ours
from benchmarks.inference_modes import MODES, RATIO
from benchmarks.model_pair import random_ids
from benchmarks.op_counter import count_steps
from benchmarks.report import finish, fmt_bytes, fmt_time, md_table, oom_reason, settings_line, write_results

NAME = "inference"
PRESETS = {"smoke": [32], "cpu": [512, 2048], "gpu": [1024, 8192, 32768]}  # prefill prompt lengths
DECODE = {"smoke": [32], "cpu": [512], "gpu": [1024, 8192]}  # decode KV lengths
REPS = {"smoke": 1, "cpu": 3, "gpu": 5}
STEPS = {"smoke": 2, "cpu": 8, "gpu": 32}  # decode steps per measurement (a multiple of R)
COUNT_STEPS = 4  # decode steps whose ops / syncs are counted (a multiple of R: concept and token-only steps)
REFERENCE = ("hf_static_compiled", "hf_static")  # ratios are to the first of these that ran
TARGET_SYNCS = {"ours": 0, "ours_R2": 1}  # issue 35 item 1: host reads per decode step
TARGET_GPU_VS_HF = 1.0  # GPU: plain-MoE decode at batch 1 / transformers' StaticCache + compile
TARGET_GPU_MS_PER_LAYER = 0.3



def reference(ran: list[str]) -> str | None:
    return next((r for r in REFERENCE if r in ran), None)


def first_call(fn, device) -> tuple[float | None, str | None]:
    """Seconds of the first call (a compiled mode compiles there), or None and the one-line reason it failed."""
    t0 = time.perf_counter()
    try:
        fn()
        sync(device)
    except (torch.OutOfMemoryError, MemoryError):
        raise
    except Exception as err:  # noqa: BLE001 - a mode that cannot run here is a result, reported in the table
        return None, f"{err.__class__.__name__}: {str(err).strip().splitlines()[0][:200]}"
    return time.perf_counter() - t0, None


def ratio_cells(comp, ref: str) -> dict:
    """Per mode: time / the reference's, median of per-round ratios [q1, q3]."""
    out = {}
    for n in comp.times:
        s = comp.speedup(n, ref)  # t_n / t_ref - 1 per round
        out[n] = {"median": s["median_of_ratios"] + 1, "q1": s["ratio_q1"] + 1, "q3": s["ratio_q3"] + 1}
    return out


def bench_prefill(modes, P, vocab, s, log) -> dict:
    ids = random_ids(1, P, vocab, s.device, seed=s.seed + P)
    caches, first, failed = {}, {}, {}

    def make(name):
        def fn():
            caches[name] = modes[name].start(1, P + 1)
            return modes[name].prefill(caches[name], ids)
        return fn
    fns = {n: make(n) for n, m in modes.items() if m.prefills}
    logits = {}
    with torch.inference_mode():
        for n, fn in fns.items():
            first[n], failed[n] = first_call(lambda fn=fn, n=n: logits.__setitem__(n, fn()), s.device)
        ok = {n: f for n, f in fns.items() if failed[n] is None}
        comp = interleaved(ok, s.device, s.reps, s.warmup)
    gap = (float((logits["ours"].float() - logits["hf_static"].float()).abs().max())
           if {"ours", "hf_static"} <= set(logits) else None)
    ref = reference(list(ok))
    res = {"prompt": P, "batch": 1, "times": comp.times, "median_s": {n: comp.median(n) for n in ok},
           "first_call_s": {n: v for n, v in first.items() if v is not None},
           "failed": {n: why for n, why in failed.items() if why}, "reference": ref,
           "vs_reference": ratio_cells(comp, ref) if ref else {}, "logit_gap_ours_vs_hf": gap}
    log(f"prefill P={P}: " + ", ".join(f"{n} {fmt_time(v)}" for n, v in res["median_s"].items()))
    return res


def bench_decode(modes, B, N, steps, cap, vocab, s, log) -> dict:
    """Prefill N tokens into each mode's cache (capacity ``cap``), then ``steps`` decode steps per
    measurement, the same random tokens for every mode."""
    ids = random_ids(B, N, vocab, s.device, seed=N + B)
    fed = random_ids(B, cap - N, vocab, s.device, seed=7)  # the token fed at position N + i
    caches, pos, first, failed = {}, {}, {}, {}

    def make(name):
        def fn():
            for _ in range(steps):
                i = pos[name] - N
                modes[name].step(caches[name], fed[:, i:i + 1], pos[name])
                pos[name] += 1
        return fn
    fns = {n: make(n) for n in modes}
    with torch.inference_mode():
        for n, m in modes.items():
            caches[n] = m.start(B, cap)
            m.prefill(caches[n], ids)
            pos[n] = N
            first[n], failed[n] = first_call(fns[n], s.device)  # warms up, compiles the step
        ok = {n: f for n, f in fns.items() if failed[n] is None}
        comp = interleaved(ok, s.device, s.reps, s.warmup)
    ref = reference(list(ok))
    res = {"batch": B, "kv_len": N, "steps_per_measurement": steps, "capacity": cap, "times": comp.times,
           "ms_per_step": {n: 1e3 * comp.median(n) / steps for n in ok},
           "first_call_s": {n: v for n, v in first.items() if v is not None},
           "failed": {n: why for n, why in failed.items() if why}, "reference": ref,
           "vs_reference": ratio_cells(comp, ref) if ref else {},
           "kv": {n: modes[n].kv(caches[n], pos[n]) for n in ok}}
    log(f"decode B={B} N={N}: " + ", ".join(f"{n} {v:.3g} ms/step" for n, v in res["ms_per_step"].items()))
    return res


def count_decode(modes, B, vocab, device) -> dict:
    """Ops and host syncs per decode step of each eager mode, on a fresh 16-token cache at batch B (under
    no_grad: inference_mode hides scalar reads from the counter)."""
    P = 16
    ids = random_ids(B, P, vocab, device, seed=3)
    fed = random_ids(B, COUNT_STEPS + 1, vocab, device, seed=4)
    out = {}
    with torch.no_grad():
        for n, m in modes.items():
            if not m.counted:
                continue
            cache = m.start(B, P + COUNT_STEPS + 2)
            m.prefill(cache, ids)
            m.step(cache, fed[:, :1], P)  # a first step outside the count (lazy state)
            state = {"pos": P + 1}

            def one(m=m, cache=cache, state=state):
                i = state["pos"] - P
                m.step(cache, fed[:, i:i + 1], state["pos"])
                state["pos"] += 1
            out[n] = count_steps(one, COUNT_STEPS)
    return out


def targets(counts: dict, decode: list, layers: int, is_cuda: bool) -> list[dict]:
    """Issue 35 item 5, met or missed from the results (None: not measured on this device)."""
    out = []
    hf_ops = {B: c["hf_static"]["ops_per_step"] for B, c in counts.items() if "hf_static" in c}
    for n in ("ours", "ours_R2"):
        for B, c in counts.items():
            if n not in c:
                continue
            if B in hf_ops:
                v = c[n]["ops_per_step"] / hf_ops[B]
                out.append({"mode": n, "batch": B, "what": "decode ops per step / transformers' StaticCache (<= 1)",
                            "value": v, "met": v <= 1.0})
            v = c[n]["syncs_per_step"]
            out.append({"mode": n, "batch": B, "what": f"host syncs per decode step (<= {TARGET_SYNCS[n]})",
                        "value": v, "met": v <= TARGET_SYNCS[n]})
    b1 = [d for d in decode if d["batch"] == 1 and "ours" in d["ms_per_step"]]
    for d in b1:
        # GPU targets: the value and verdict on a GPU only (a CPU time says nothing about them)
        ratio = d["vs_reference"]["ours"]["median"] if is_cuda and d["reference"] == "hf_static_compiled" else None
        out.append({"mode": "ours", "batch": 1, "kv_len": d["kv_len"],
                    "what": f"GPU: decode time / transformers' StaticCache + compile (<= {TARGET_GPU_VS_HF:g})",
                    "value": ratio, "met": None if ratio is None else ratio <= TARGET_GPU_VS_HF})
        ms = d["ms_per_step"]["ours"] / layers if is_cuda else None
        out.append({"mode": "ours", "batch": 1, "kv_len": d["kv_len"],
                    "what": f"GPU: decode ms per layer (<= {TARGET_GPU_MS_PER_LAYER:g})", "value": ms,
                    "met": None if ms is None else ms <= TARGET_GPU_MS_PER_LAYER})
    return out


def _ratio(cell: dict | None) -> str:
    return "" if cell is None else f" ({cell['median']:.2f}x)"


def markdown(payload: dict, s, modes: dict) -> str:
    labels = {n: m.label for n, m in modes.items()}
    pre, dec, counts = (payload["results"][k] for k in ("prefill", "decode", "counts"))
    pre_rows = []
    for n in modes:
        cells = []
        for r in pre:
            t = r["median_s"].get(n)
            cells.append(("did not run" if n in r["failed"] else "= eager (not compiled)") if t is None
                         else fmt_time(t) + _ratio(r["vs_reference"].get(n)))
        first = [r["first_call_s"].get(n) for r in pre]
        pre_rows.append([labels[n], *cells, " / ".join("-" if f is None else f"{f:.3g} s" for f in first)])
    dec_rows = []
    for n in modes:
        cells = []
        for r in dec:
            t = r["ms_per_step"].get(n)
            cells.append("did not run" if t is None else f"{t:.3g} ms" + _ratio(r["vs_reference"].get(n)))
        ops = [counts[B].get(n) for B in counts]
        ops_cell = " / ".join(f"{c['ops_per_step']:,.0f}" if c else "n/a" for c in ops)
        sync_cell = " / ".join(f"{c['syncs_per_step']:.2f}" if c else "n/a" for c in ops)
        kv = dec[-1]["kv"].get(n) if dec else None
        kv_cell = "n/a" if kv is None else f"{fmt_bytes(kv['allocated_bytes'])} / {fmt_bytes(kv['held_bytes'])}"
        first = " / ".join("-" if r["first_call_s"].get(n) is None else f"{r['first_call_s'][n]:.3g} s" for r in dec)
        dec_rows.append([labels[n], *cells, ops_cell, sync_cell, kv_cell, first])
    batches = " / ".join(f"B={B}" for B in counts)
    failed = sorted({f"- {labels[n]} ({what}): {why}" for what, rs in (("prefill", pre), ("decode", dec))
                     for r in rs for n, why in r["failed"].items()})
    def refs(rows):
        return " / ".join(labels.get(r, str(r)) for r in dict.fromkeys(r["reference"] for r in rows))
    ref_note = f"ratios are to {refs(pre)} (prefill) and {refs(dec)} (decode)"
    verdicts = "".join(
        f"- {labels[t['mode']]}, B={t['batch']}{', KV ' + format(t['kv_len'], ',') if 'kv_len' in t else ''}: "
        f"{t['what']}: " + ("n/a" if t["value"] is None else f"{t['value']:.3g}") + " -> "
        + ("not measured on this device" if t["met"] is None else "met" if t["met"] else "MISSED") + "\n"
        for t in payload["targets"])
    sh = payload["shape"]
    return (f"## Inference: which to pick (same imported weights)\n\n{settings_line(s)}\n\n"
            f"- transformers' Qwen3MoeForCausalLM ({sh['num_hidden_layers']} layers, hidden {sh['hidden_size']}, "
            f"{sh['num_experts']} experts top-{sh['num_experts_per_tok']}, vocab {sh['vocab_size']}; random init, "
            "`grouped_mm` experts, sdpa), imported with `vlm.hf_import`; the ConceptMoE converted from it by "
            f"`vlm.convert` (strategy topk, boundaries fixed at R = {RATIO:g})\n"
            f"- {ref_note}: median of per-round ratios, interleaved rounds (< 1: faster); 'first call' = the "
            "first prefill / decode measurement per size (a compiled mode compiles there; excluded from the "
            "medians); transformers' own generate compiles the decode steps only and runs the prefill eager"
            + (" (here the prefill was compiled too: --compile-prefill)" if payload["compile_prefill"] else "")
            + "\n"
            f"- ops / syncs: kernel-launching ATen ops and host reads per decode step ({COUNT_STEPS} steps "
            f"counted, {batches}); a compiled graph's fused kernels are not ATen ops (n/a)\n"
            + "".join(f + "\n" for f in failed)
            + "\n### Prefill (batch 1, fresh caches)\n\n"
            + md_table(["mode", *(f"{r['prompt']:,} tokens" for r in pre), "first call"], pre_rows)
            + "\n\nmax logit gap ours vs transformers (prefill): "
            + ", ".join("n/a" if r["logit_gap_ours_vs_hf"] is None else f"{r['logit_gap_ours_vs_hf']:.1e}" for r in pre)
            + "\n\n### Decode (per step; a step emits one token per row)\n\n"
            + md_table(["mode", *(f"B={r['batch']}, KV {r['kv_len']:,}" for r in dec),
                        f"ops per step ({batches})", f"syncs per step ({batches})",
                        f"KV allocated / held (B={dec[-1]['batch'] if dec else '-'}, after its steps)",
                        "first call (compiles)"], dec_rows)
            + "\n\n### Targets (issue 35)\n\n" + verdicts)


def run(argv=None) -> dict:
    ap = base_parser(NAME, __doc__.split("\n")[0], "prefill prompt lengths, e.g. 1K,8K,32K")
    ap.add_argument("--decode-sizes", default=None, help="decode KV lengths (comma list; default per preset)")
    ap.add_argument("--batches", default=None, help="decode batch sizes (default 1,8; smoke 1,2)")
    ap.add_argument("--modes", default=None, help=f"comma list of {', '.join(MODES)} (default: all; "
                    "ours_cudagraph on CUDA only)")
    ap.add_argument("--compile-prefill", action="store_true",
                    help="hf_static_compiled: compile the prefill too (one compile per prompt shape; transformers' "
                         "generate runs it eager)")
    args = ap.parse_args(argv)
    default = [n for n in MODES if n != "ours_cudagraph" or args.device.startswith("cuda")]
    names = [n.strip() for n in args.modes.split(",") if n.strip()] if args.modes else default
    bad = set(names) - set(MODES)
    if bad or not names:
        ap.error(f"unknown --modes: {', '.join(sorted(bad)) or '(none)'}; choose from {', '.join(MODES)}")
    s = setup(NAME, args, PRESETS, REPS)
    log = logger(s)
    import transformers
    transformers.utils.logging.disable_progress_bar()
    key = "smoke" if s.smoke else ("gpu" if s.is_cuda else "cpu")
    shape = SHAPES[key]
    decode_sizes = parse_sizes(args.decode_sizes, DECODE, key)[1] if args.decode_sizes else DECODE[key]
    batches = [int(b) for b in (args.batches or ("1,2" if s.smoke else "1,8")).split(",")]
    steps = STEPS[key]
    cap = max(decode_sizes) + steps * (s.warmup + s.reps + 1) + 2  # one capacity for every decode size
    payload = {"shape": shape, "ratio": RATIO, "modes": names, "transformers": transformers.__version__,
               "compile_prefill": args.compile_prefill,
               "results": {"prefill": [], "decode": [], "counts": {}}, "targets": []}
    modes, out = {}, payload["results"]

    def report():
        return payload, markdown(payload, s, modes)

    with tempfile.TemporaryDirectory() as tmp:
        src = build_hf("qwen3_moe", shape, Path(tmp) / "hf", max(max(s.sizes), cap) + 16, seed=s.seed)
        hf = load_hf("qwen3_moe", src, s.device, s.dtype).eval()
        plain, con = load_ours(src, Path(tmp) / "R2", RATIO, s.device, s.dtype, s.seed, concept="ours_R2" in names)
    if con is not None:
        con.config.boundary_mode = "fixed"  # achieved R exactly RATIO (the chunker reads its config each call)
    plain.eval()
    modes.update({n: MODES[n](plain, con, hf, args) for n in names})
    log(f"modes: {', '.join(names)}; prefill {s.sizes}, decode KV {decode_sizes} x batches {batches}")
    for B in batches:
        out["counts"][B] = count_decode(modes, B, shape["vocab_size"], s.device)
        log(f"ops / syncs per step at B={B}: " + ", ".join(
            f"{n} {c['ops_per_step']:.0f} / {c['syncs_per_step']:.2f}" for n, c in out["counts"][B].items()))
    for P in s.sizes:
        try:
            out["prefill"].append(bench_prefill(modes, P, shape["vocab_size"], s, log))
        except (torch.OutOfMemoryError, MemoryError) as err:
            log(f"prefill P={P}: {oom_reason(err)}; stopping the prefill sizes here")
            break
        free_memory(s.device)
        write_results(s, *report(), partial=True)
    for B in batches:
        for N in decode_sizes:
            try:
                out["decode"].append(bench_decode(modes, B, N, steps, cap, shape["vocab_size"], s, log))
            except (torch.OutOfMemoryError, MemoryError) as err:
                log(f"decode B={B} N={N}: {oom_reason(err)}; skipping the larger lengths")
                break
            free_memory(s.device)
            payload["targets"] = targets(out["counts"], out["decode"], shape["num_hidden_layers"], s.is_cuda)
            write_results(s, *report(), partial=True)
    payload["targets"] = targets(out["counts"], out["decode"], shape["num_hidden_layers"], s.is_cuda)

    def plot(plt):
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        for ax, rows, key, title in ((a1, out["prefill"], "prompt", "prefill"),
                                     (a2, out["decode"], "kv_len", "decode per step")):
            labels = [f"B={r.get('batch', 1)} {r[key]:,}" for r in rows]
            for i, n in enumerate(modes):
                vals = [r["vs_reference"].get(n, {}).get("median", float("nan")) for r in rows]
                ax.bar([j + i * 0.8 / len(modes) for j in range(len(rows))], vals, width=0.8 / len(modes),
                       label=modes[n].label)
            ax.set_xticks(range(len(rows)), labels, fontsize=8)
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set(ylabel="time / transformers' compiled", title=title)
        a1.legend(fontsize=7)
        return fig

    return finish(s, report, plot, log)


if __name__ == "__main__":
    run()
