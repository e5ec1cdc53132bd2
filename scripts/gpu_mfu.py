"""Helpers of ``scripts/gpu_check.sh``'s step mfu-1b (configs/train/gpu_mfu.yaml).

    python scripts/gpu_mfu.py docs     # runs/gpu_mfu/docs.jsonl: Shakespeare scenes as documents
    python scripts/gpu_mfu.py report   # the MFU of the last logged window, against the 40% target

``docs`` cuts data/default/shakespeare_train.txt into documents of 20-300 lines (seeded; ~100-2,000
tokens), so that an 8K-token row packs several documents. ``report`` reads runs/gpu_mfu/metrics.jsonl.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "runs" / "gpu_mfu"
TARGET = 0.40


def docs() -> int:
    lines = (ROOT / "data" / "default" / "shakespeare_train.txt").read_text(encoding="utf-8").splitlines()
    rng, out, i = random.Random(0), [], 0
    while i < len(lines):
        n = rng.randint(20, 300)
        out.append("\n".join(lines[i:i + n]))
        i += n
    RUN.mkdir(parents=True, exist_ok=True)
    with open(RUN / "docs.jsonl", "w", encoding="utf-8") as f:
        for text in out:
            f.write(json.dumps({"text": text}) + "\n")
    print(f"gpu_mfu: {len(out)} documents -> {RUN / 'docs.jsonl'}")
    return 0


def report() -> int:
    recs = [json.loads(line) for line in (RUN / "metrics.jsonl").read_text().splitlines() if '"mfu"' in line]
    if not recs:
        print("gpu_mfu: no record with an MFU in runs/gpu_mfu/metrics.jsonl", file=sys.stderr)
        return 1
    r = recs[-1]
    verdict = "met" if r["mfu"] >= TARGET else "MISSED"
    print(f"gpu_mfu: step {r['step']}: MFU {r['mfu']:.1%} (target >= {TARGET:.0%}: {verdict}), "
          f"{r['tokens_per_s']:,.0f} tokens/s, mean document {r['mean_doc_len']:.0f} tokens, "
          f"achieved R {r.get('ratio')}, {r['flops_per_token'] / 1e6:.0f} MFLOP/token")
    return 0


if __name__ == "__main__":
    sys.exit({"docs": docs, "report": report}[sys.argv[1]]())
