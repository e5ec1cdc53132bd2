"""Soak: a long single-process CPU run of the tiny VLM on the default data with frequent
checkpoints; passes if memory, open file descriptors and the checkpoint count stay bounded
(criteria in ``run_soak``)."""
from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from vlm.reliability import runs
from vlm.training import checkpoint as ckpt
from vlm.config.train import REPO_ROOT

KEEP_LAST = 2
MAX_RSS_GROWTH = 0.05


@dataclass
class SoakResult:
    ok: bool
    steps: int
    ckpt_every: int
    rss_warm_mib: float
    rss_end_mib: float
    rss_peak_mib: float
    rss_growth: float
    fds_warm: int
    fds_end: int
    max_ckpts_seen: int
    ckpts_end: int
    seconds: float
    detail: str

    def to_dict(self) -> dict:
        return asdict(self)


def run_soak(work: Path, steps: int = 2000, ckpt_every: int = 100, log_every: int = 25,
             micro_batch: int = 8) -> SoakResult:
    """The trainer logs its resident memory and open file descriptors with every record
    (``rss_mib``, ``open_fds``); while it runs we count the checkpoint folders. Pass: resident
    memory grows < 5% from the end of warm-up (the first 10% of the steps) to the end, the open
    file descriptors do not grow, and there are never more than keep_last (+1 while a save is
    between its rename and the pruning) complete checkpoints, keep_last at the end."""
    name = f"soak-{steps}"
    overrides = [f"name={name}", f"output_dir={work}", f"train.max_steps={steps}",
                 f"train.micro_batch_size={micro_batch}", "train.warmup_steps=10", f"log.every_steps={log_every}",
                 "log.progress_bar=false", "log.tensorboard=true", f"checkpoint.every_steps={ckpt_every}",
                 f"checkpoint.keep_last={KEEP_LAST}", "checkpoint.export_hf=false", "eval.every_steps=0"]
    cmd = [sys.executable, "-m", "vlm.train", "--config", str(REPO_ROOT / "configs/train/default.yaml"),
           "--no-eval", *overrides]
    run_dir = Path(work) / name
    ck = run_dir / "ckpt"
    log = Path(work) / f"{name}.log"
    t0 = time.monotonic()
    max_seen = 0
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=runs.clean_env(), stdout=f, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            max_seen = max(max_seen, len(ckpt.list_checkpoints(ck)))
            time.sleep(0.25)
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        return SoakResult(False, 0, ckpt_every, 0, 0, 0, 0, 0, 0, max_seen, 0, seconds,
                          f"the soak run failed (exit {proc.returncode}): {' | '.join(tail)}")
    recs = runs.records(run_dir)
    warm_step = max(1, steps // 10)
    warm = next(r for r in recs if r["step"] >= warm_step)
    end = recs[-1]
    rss = [r["rss_mib"] for r in recs if r["step"] >= warm_step]
    growth = (end["rss_mib"] - warm["rss_mib"]) / warm["rss_mib"]
    ckpts_end = len(ckpt.list_checkpoints(ck))
    checks = {f"rss growth {growth:+.1%} < {MAX_RSS_GROWTH:.0%}": growth < MAX_RSS_GROWTH,
              f"open fds {warm['open_fds']} -> {end['open_fds']} (no growth)": end["open_fds"] <= warm["open_fds"],
              f"checkpoints at most {KEEP_LAST + 1} at once (saw {max_seen}), {KEEP_LAST} at the end ({ckpts_end})":
                  max_seen <= KEEP_LAST + 1 and ckpts_end == KEEP_LAST,
              f"all {steps} steps": end["step"] == steps}
    return SoakResult(all(checks.values()), end["step"], ckpt_every, warm["rss_mib"], end["rss_mib"], max(rss),
                      growth, warm["open_fds"], end["open_fds"], max_seen, ckpts_end, seconds,
                      "; ".join(("" if ok else "FAILED: ") + what for what, ok in checks.items()))
