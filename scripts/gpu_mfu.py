"""Helpers of ``scripts/gpu_check.sh``'s step mfu-1b (configs/train/gpu_mfu.yaml).

    python scripts/gpu_mfu.py docs     # runs/gpu_mfu/docs.jsonl: Shakespeare scenes as documents
    python scripts/gpu_mfu.py report   # the MFU of the last logged window, against the 40% target
    python scripts/gpu_mfu.py report --allow-unsteady   # the CPU rehearsal: too few steps for the router

``docs`` cuts data/default/shakespeare_train.txt into documents of 20-300 lines (seeded; ~100-3,000
tokens), so that an 8K-token row packs several documents. ``report`` reads runs/gpu_mfu/metrics.jsonl
and profile.json: tokens per step, step time, MFU, achieved R against the target (the window must be
steady: within 10%), the GPU's idle fraction and top kernels of the profiled steps.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "runs" / "gpu_mfu"
TARGET = 0.40


def write_docs(path: Path, data_dir: Path = ROOT / "data" / "default") -> int:
    """Cut the Shakespeare text into seeded documents of 20-300 lines, one JSON line each; returns the count."""
    lines = (data_dir / "shakespeare_train.txt").read_text(encoding="utf-8").splitlines()
    rng, out, i = random.Random(0), [], 0
    while i < len(lines):
        n = rng.randint(20, 300)
        out.append("\n".join(lines[i:i + n]))
        i += n
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for text in out:
            f.write(json.dumps({"text": text}) + "\n")
    return len(out)


def docs() -> int:
    n = write_docs(RUN / "docs.jsonl")
    print(f"gpu_mfu: {n} documents -> {RUN / 'docs.jsonl'}")
    return 0


STEADY = 0.10  # the MFU window counts once the achieved ratio R is within 10% of the target


def target_ratio(run: Path) -> float | None:
    """The model's target R (None: no chunking), from the run's own train_config.json."""
    from vlm.config.train import load_train_config
    from vlm.training.build import build_model_config, text_config_of

    cfg = load_train_config(raw=json.loads((run / "train_config.json").read_text()))
    text = text_config_of(build_model_config(cfg))
    return float(text.target_ratio) if text.chunking else None


def is_steady(ratio: float | None, target: float | None) -> bool:
    """The router has reached its target: achieved R within ``STEADY`` of it (no chunking: always)."""
    return target is None or (ratio is not None and abs(ratio - target) <= STEADY * target)


def report(allow_unsteady: bool = False) -> int:
    """The MFU of the last logged window, once the router is steady; the profiled window's GPU idle
    fraction and top kernels (profile.json). Exit 1 when the window is not steady (unless allowed)."""
    recs = [json.loads(line) for line in (RUN / "metrics.jsonl").read_text().splitlines() if '"mfu"' in line]
    if not recs:
        print("gpu_mfu: no record with an MFU in runs/gpu_mfu/metrics.jsonl", file=sys.stderr)
        return 1
    lines: list[str] = []
    r, prev = recs[-1], (recs[-2]["step"] if len(recs) > 1 else 0)
    steps = r["step"] - prev
    target = target_ratio(RUN)
    ratio = r.get("ratio")
    steady = is_steady(ratio, target)
    step_s = r["tokens"] / max(r["tokens_per_s"], 1e-9) / max(steps, 1)
    verdict = "met" if r["mfu"] >= TARGET else "MISSED"
    lines.append(f"gpu_mfu: steps {prev + 1}-{r['step']}: MFU {r['mfu']:.1%} (target >= {TARGET:.0%}: {verdict}), "
                 f"{r['tokens'] / max(steps, 1):,.0f} tokens/step, {step_s * 1e3:.1f} ms/step, "
                 f"{r['tokens_per_s']:,.0f} tokens/s, mean document {r['mean_doc_len']:.0f} tokens, "
                 f"{r['flops_per_token'] / 1e6:.0f} MFLOP/token")
    if target is not None:
        state = "steady" if steady else f"NOT steady (outside {STEADY:.0%})"
        lines.append(f"gpu_mfu: achieved R {ratio if ratio is None else round(ratio, 3)} vs target {target:g}: {state}")
    prof = RUN / "profile.json"
    if prof.is_file():
        p = json.loads(prof.read_text())
        idle = p["gpu_idle_fraction"]
        lines.append(f"gpu_mfu: profiled steps {p['steps'][0]}-{p['steps'][1]}: GPU idle "
                     f"{'n/a (no GPU)' if idle is None else f'{idle:.1%}'} of {p['window_s']:.2f} s; top "
                     + ("kernels" if idle is not None else "ops") + " per step:")
        for k in p["top"][:10]:
            lines.append(f"    {k['ms_per_step']:9.2f} ms  {k['calls_per_step']:7.1f} calls  {k['name'][:90]}")
    else:
        lines.append("gpu_mfu: no profile.json (log.profile_steps unset): GPU idle fraction not measured")
    print("\n".join(lines))
    (RUN / "mfu_report.txt").write_text("\n".join(lines) + "\n")
    return 0 if steady or allow_unsteady else 1


if __name__ == "__main__":
    if sys.argv[1] == "report":
        sys.exit(report(allow_unsteady="--allow-unsteady" in sys.argv[2:]))
    sys.exit(docs())
