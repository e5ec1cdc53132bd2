"""Time one test tier and record it (docs/results/tests/<tier>.json): wall time, the counts pytest reports, the
machine's load before and after, its cores and the commit, so README.md quotes the figure with its load.

    .venv/bin/python scripts/test_timing.py unit          # the unit tier, as make test-unit runs it
    .venv/bin/python scripts/test_timing.py integration   # the integration tier, as make test runs it
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script file
    sys.path.insert(0, str(ROOT))
from vlm.training.peak import cpu_model

OUT = ROOT / "docs" / "results" / "tests"
TIERS = {"unit": (["tests/unit", "-m", "not integration"], {"OMP_NUM_THREADS": "1"}),
         "integration": (["-m", "integration"], {})}


def counts(text: str) -> dict:
    """pytest's closing line -> {"passed": n, "failed": n, ...}."""
    last = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", last[-1])} if last else {}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in TIERS:
        print(f"usage: test_timing.py {{{','.join(TIERS)}}}", file=sys.stderr)
        return 2
    tier = argv[0]
    args, env = TIERS[tier]
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", "vlm", "tests", "data_pipelines",
                            "eval_suites", "vision_encoders", "benchmarks", "scripts"]).returncode != 0
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider"], cwd=ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rec = {"tier": tier, "wall_s": round(wall, 1), **counts(proc.stdout), "returncode": proc.returncode,
           "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2), "cpu": cpu_model(),
           "cpu_count": os.cpu_count(),
           "commit": commit, "dirty": dirty, "date": time.strftime("%Y-%m-%d %H:%M")}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{tier}.json").write_text(json.dumps(rec, indent=1) + "\n")
    print(proc.stdout[-2000:])
    print(f"[test_timing] {tier}: {rec} -> {OUT / (tier + '.json')}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
