"""The GPU check's verdicts (a step of scripts/gpu_check.sh): each new fast path run beside its reference
on the same inputs, its results compared (``correct``) and both timed interleaved (``faster``: the median
of per-round ratios reference / new above 1 + MARGIN). Writes ``gpu_verdicts.json`` (the format of
vlm/modeling/verdicts.py: copy it over vlm/modeling/gpu_verdicts.json to flip the defaults of ``auto``)
and ``gpu_verdicts.md`` (path x correct / faster / ``auto`` on CUDA). A path that raises is ``correct:
false``; one that cannot run here (a package missing) stays null. On a CPU nothing is measured (every
cell 'not measured'); ``--rehearse`` there runs the capacity check at tiny sizes, so the harness is
exercised before a GPU is spent on it.

    python -m scripts.gpu.verdicts --device cuda --out DIR [--reps 10]
    python -m scripts.gpu.verdicts --committed   # docs/results/gpu_verdicts.md from the committed file
"""
from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import torch.nn as nn

from benchmarks.harness import interleaved
from vlm.modeling import fused_kernels as fk
from vlm.modeling import verdicts
from vlm.modeling.configuration_conceptmoe import ConceptMoEConfig
from vlm.modeling.linear_scan import linear_scan
from vlm.modeling.modeling_conceptmoe import ConceptMoEForCausalLM, chunked_lm_loss

ROOT = Path(__file__).resolve().parents[2]
COMMITTED_MD = ROOT / "docs" / "results" / "gpu_verdicts.md"
MARGIN = 0.02  # a new path counts as faster when its median per-round speedup is above 2%
PRESET = ROOT / "configs" / "model" / "mfu_1b.yaml"
SMALL = {"num_hidden_layers": 4, "chunking.encoder_layers": 1, "chunking.decoder_layers": 1}  # mfu_1b's widths


def _close(a, b, rtol: float, atol: float) -> bool:
    return all(x is not None and y is not None and torch.allclose(x.float(), y.float(), rtol=rtol, atol=atol)
               for x, y in zip(a, b)) and len(a) == len(b)


def _faster(comp, ref: str, new: str) -> tuple[bool, dict]:
    sp = comp.speedup(ref, new)
    detail = {"speedup_median_of_ratios": round(sp["median_of_ratios"], 4), "ratio_q1": round(sp["ratio_q1"], 4),
              "ratio_q3": round(sp["ratio_q3"], 4), f"{ref}_median_s": comp.median(ref), f"{new}_median_s": comp.median(new)}
    return sp["median_of_ratios"] > MARGIN, detail


# --- the dechunk EMA scan: Triton vs the torch chunked scan ---------------------------------------------
def ema_scan_triton(device, reps, log, tiny=False):
    B, M, D = (2, 300, 16) if tiny else (8, 4096, 1024)
    g = torch.Generator().manual_seed(0)
    a = torch.rand(B, M, generator=g).to(device).requires_grad_()
    x = torch.randn(B, M, D, generator=g).to(device).requires_grad_()
    dy = torch.randn(B, M, D, generator=g).to(device)

    def run(impl):
        a.grad = x.grad = None
        y = linear_scan(a, x, impl=impl)
        y.backward(dy)
        return [y.detach(), a.grad, x.grad]
    correct = _close(run("torch"), run("triton"), rtol=1e-3, atol=1e-3)
    comp = interleaved({"torch": lambda: run("torch"), "triton": lambda: run("triton")}, device, reps, 2, log=log)
    faster, detail = _faster(comp, "torch", "triton")
    return correct, faster, {"shape_BMD": [B, M, D], **detail}


# --- the concept sequence at capacity T vs the exact count (one device read) ----------------------------
def _packed(T: int, vocab: int, device) -> tuple[dict, object]:
    from benchmarks.overhead import packed_batch
    b = packed_batch(T, vocab)
    keys = ("input_ids", "labels", "attention_mask", "position_ids", "segment_ids")
    return {k: b[k].to(device) for k in keys}, b["doc_layout"]


def _train_step(model, batch, layout, capacity: str):
    model.config.runtime.capacity = capacity
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # the boundary noise draws the same numbers whatever M
    out = model(**batch, doc_layout=layout)
    out.loss.backward()
    return [out.loss.detach()] + [p.grad for p in model.parameters() if p.grad is not None]


def capacity_tokens(device, reps, log, tiny=False):
    over = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
            "moe_intermediate_size": 64, **SMALL} if tiny else SMALL
    T = 256 if tiny else 8192
    torch.manual_seed(0)
    model = ConceptMoEForCausalLM(ConceptMoEConfig.from_yaml(PRESET, **over)).to(device).train()
    batch, layout = _packed(T, model.config.vocab_size, device)
    correct = _close(_train_step(model, batch, layout, "exact"), _train_step(model, batch, layout, "tokens"),
                     rtol=1e-4, atol=1e-5)
    if device.type == "cuda":
        model.to(torch.bfloat16)
    comp = interleaved({c: (lambda c=c: _train_step(model, batch, layout, c)) for c in ("exact", "tokens")},
                       device, reps, 2, log=log)
    faster, detail = _faster(comp, "exact", "tokens")
    return correct, faster, {"tokens": T, "config": f"{PRESET.name} + {over}", **detail}


# --- captured decode (CUDA graphs) vs the same fixed-shape step eager -----------------------------------
def decode_cudagraph(device, reps, log, tiny=False):
    B, T, steps = 8, 128, 32
    torch.manual_seed(0)
    model = ConceptMoEForCausalLM(ConceptMoEConfig.from_yaml(PRESET, **SMALL)).to(device, torch.bfloat16).eval()
    ids = torch.randint(8, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(1)).to(device)
    held = {}

    @torch.no_grad()
    def start(decode):  # untimed: the state, the prefill and two steps (the capture, for cudagraph)
        state = model.start_decoding(B, T + steps + 4, decode=decode)
        tok = model.prefill(state, ids).argmax(-1)
        for _ in range(2):
            tok = model.step(state, tok).argmax(-1)
        held[decode] = (state, tok)

    @torch.no_grad()
    def run(decode):
        state, tok = held[decode]
        out = []
        for _ in range(steps):
            tok = model.step(state, tok).argmax(-1)
            out.append(tok)
        return torch.stack(out, 1)
    start("static"), start("cudagraph")
    correct = torch.equal(run("static"), run("cudagraph"))
    comp = interleaved({d: (lambda d=d: run(d)) for d in ("static", "cudagraph")}, device, reps, 1,
                       between=start, log=log)
    faster, detail = _faster(comp, "static", "cudagraph")
    return correct, faster, {"batch": B, "prompt": T, "steps_timed": steps, **detail}


# --- each fused kernel vs its torch path ------------------------------------------------------------------
def _fused_case(kernel: str, N: int, c, device, dtype):
    """(leaves, call): ``call()`` runs the kernel's forward + backward through the active implementation."""
    g = torch.Generator().manual_seed(0)
    leaf = lambda t: t.to(device, dtype).requires_grad_()  # noqa: E731
    D = c.hidden_size
    if kernel == "cross_entropy":
        head = nn.Linear(D, c.vocab_size, bias=False).to(device, dtype)
        h = leaf(torch.randn(1, N, D, generator=g))
        labels = torch.randint(0, c.vocab_size, (1, N), generator=g)
        labels[:, ::7] = -100
        labels = labels.to(device)
        leaves = [h, head.weight]

        def call():
            loss = chunked_lm_loss(head, h, labels)
            loss.backward()
            return loss.detach()
    elif kernel == "rms_norm":
        x, w = leaf(torch.randn(N, D, generator=g)), leaf(torch.rand(D, generator=g) + 0.5)
        dy = torch.randn(N, D, generator=g).to(device, dtype)
        leaves = [x, w]

        def call():
            y = fk.rms_norm(x, w, c.rms_norm_eps)
            y.backward(dy)
            return y.detach()
    else:
        E, I, S = c.num_experts, c.moe_intermediate_size, N * c.top_k
        x = leaf(torch.randn(S, D, generator=g))
        w_gu, w_d = leaf(torch.randn(E, D, 2 * I, generator=g) * D ** -0.5), leaf(torch.randn(E, I, D, generator=g) * I ** -0.5)
        rw = leaf(torch.rand(S, generator=g))
        offs = torch.linspace(0, S, E + 1)[1:].round().to(device, torch.int32)
        dy = torch.randn(S, D, generator=g).to(device, dtype)
        leaves = [x, w_gu, w_d, rw]

        def call():
            y = fk.IMPL["swiglu"].apply(x, offs, w_gu, w_d, rw)
            y.backward(dy)
            return y.detach()
    return leaves, call


def _under(kernel: str, name: str, leaves, call):
    def run():
        for t in leaves:
            t.grad = None
        with fk.use(**{kernel: name}):
            return [call()] + [t.grad for t in leaves]
    return run


def fused(kernel: str):
    def check(device, reps, log, tiny=False):
        why = fk.why_not(kernel, device.type)
        if why is not None:
            return None, None, {"not_run": why}
        c, new = ConceptMoEConfig.from_yaml(PRESET), fk.FUSED[kernel]
        leaves, call = _fused_case(kernel, 4096, c, device, torch.float32)
        correct = _close(_under(kernel, "torch", leaves, call)(), _under(kernel, new, leaves, call)(),
                         rtol=2e-3, atol=2e-4)
        leaves, call = _fused_case(kernel, 32768, c, device, torch.bfloat16)
        comp = interleaved({n: _under(kernel, n, leaves, call) for n in ("torch", new)}, device, reps, 2, log=log)
        faster, detail = _faster(comp, "torch", new)
        return correct, faster, {"tokens": 32768, "dtype": "bfloat16", **detail}
    return check


CHECKS = {"ema_scan_triton": ema_scan_triton, "capacity_tokens": capacity_tokens, "decode_cudagraph": decode_cudagraph,
          **{f"fused_{k}_{n}": fused(k) for k, n in fk.FUSED.items()}}


def measure(device: torch.device, reps: int, log=print, rehearse: bool = False) -> dict:
    """The verdict table of this device (``verdicts.py``'s format, plus ``details`` per path)."""
    table = {"note": "written by scripts/gpu/verdicts.py; copy over vlm/modeling/gpu_verdicts.json to flip the "
                     "defaults of auto on CUDA", **verdicts.unmeasured(), "details": {}}
    if device.type != "cuda":
        for name in table["paths"]:
            table["details"][name] = {"not_run": f"the device is {device.type}: verdicts are a GPU's"}
        if rehearse:  # the harness on tiny sizes; its figures are not a verdict
            c, f, d = capacity_tokens(device, 1, log, tiny=True)
            table["details"]["capacity_tokens"]["rehearsal"] = {"correct": c, "faster": f, **d}
        return table
    stamp = (f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}")
    for name, check in CHECKS.items():
        log(f"[verdicts] {name}")
        try:
            correct, faster, detail = check(device, reps, log)
        except Exception as err:  # the path cannot run here: it is not correct, whatever its speed
            correct, faster, detail = False, None, {"error": f"{type(err).__name__}: {err}"[:400]}
        torch.cuda.empty_cache()
        entry = table["paths"][name]
        entry.update(correct=correct, faster=faster)
        entry["measured_on"] = stamp if correct is not None else None
        table["details"][name] = detail
        log(f"[verdicts] {name}: correct {correct}, faster {entry['faster']}, {detail}")
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", help="folder for gpu_verdicts.json and gpu_verdicts.md")
    ap.add_argument("--committed", action="store_true",
                    help=f"write {COMMITTED_MD.relative_to(ROOT)} from vlm/modeling/gpu_verdicts.json, measure nothing")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rehearse", action="store_true", help="on a CPU: run the capacity check at tiny sizes")
    args = ap.parse_args(argv)
    if args.committed:
        COMMITTED_MD.write_text(render_md(verdicts.load(), "vlm/modeling/gpu_verdicts.json (committed)"))
        return 0
    if not args.out:
        ap.error("--out is required (or --committed)")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"verdicts: --device {args.device} but torch sees no CUDA device")
        return 2
    table = measure(device, args.reps, rehearse=args.rehearse)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_verdicts.json").write_text(json.dumps(table, indent=2, default=str) + "\n")
    md = render_md(table, f"this run, device {device}")
    (out / "gpu_verdicts.md").write_text(md)
    print(md)
    return 0


def render_md(table: dict, source: str) -> str:
    """The markdown page: what the check does, then ``verdicts.render``'s table of ``source``."""
    head = ("# GPU verdicts: which fast path `auto` takes on CUDA\n\n"
            f"Verdicts of {source}. `python -m scripts.gpu.verdicts` (a step of `scripts/gpu_check.sh`) "
            "runs each new path beside its reference on the same inputs on a GPU; correct = equal results "
            f"(outputs and gradients within the check's tolerance), faster = the median of per-round time ratios "
            f"above {1 + MARGIN:.2f}. `auto` on CUDA takes a new path only where both are yes "
            "(`vlm/modeling/gpu_verdicts.json`, read by `vlm/modeling/verdicts.py`).\n\n")
    if all(e["correct"] is None and e["faster"] is None for e in table["paths"].values()):
        head += "Nothing measured yet: `auto` keeps every reference path on CUDA.\n\n"
    return head + verdicts.render(table)


if __name__ == "__main__":
    raise SystemExit(main())
