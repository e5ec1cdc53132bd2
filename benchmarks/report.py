"""Results files of a benchmark: ``<out>/<name>.json`` (machine, settings, raw times, derived figures),
``<name>.md`` (the table) and ``<name>.png`` (the plot), plus the number formats of the tables."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Callable

import torch

from benchmarks.cli import Settings
from benchmarks.machine import load_average, machine_info


def fmt_time(s: float) -> str:
    if s != s:  # nan
        return "n/a"
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def fmt_pct(x: float | None, digits: int = 1) -> str:
    if x is None or x != x:
        return "n/a"
    return f"{x * 100:+.{digits}f}%"


def fmt_num(x: float | None, unit: str = "") -> str:
    if x is None or x != x:
        return "n/a"
    for div, suf in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suf}{unit}"
    return f"{x:.3g}{unit}"


def fmt_median_iqr(st: dict) -> str:
    """``median [q1-q3]`` of a ``harness.stats`` dict of seconds."""
    return f"{fmt_time(st['median'])} [{fmt_time(st['q1'])}-{fmt_time(st['q3'])}]"


def oom_reason(err: BaseException) -> str:
    """The ``skipped`` text of a size that ran out of memory."""
    return f"out of memory: {str(err).splitlines()[0][:200]}"


def md_table(headers: list, rows: list) -> str:
    align = ["---"] + ["---:"] * (len(headers) - 1)
    lines = ["| " + " | ".join(str(h) for h in headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def settings_line(s: Settings, extra: str = "") -> str:
    load = load_average()
    return (f"device {s.device}, {str(s.dtype).replace('torch.', '')}, torch threads {s.threads}, "
            f"{s.reps} timed rounds (+{s.warmup} warm-up) interleaved, medians [IQR]; "
            f"load average {load[0] if load else 'n/a'}" + (f"; {extra}" if extra else ""))


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        return None if x != x or math.isinf(x) else x
    if isinstance(x, (torch.dtype, torch.device, Path)):
        return str(x)
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return x


def write_results(s: Settings, payload: dict, markdown: str, plot: Callable | None = None,
                  partial: bool = False) -> dict:
    """Write <out>/<name>.json, .md (title + settings + table) and .png (``plot(plt) -> figure``).

    Benchmarks call it with ``partial=True`` after every size (no plot), so that a run stopped by a
    time limit still leaves the sizes it finished; the final call (with the plot) clears the flag.
    """
    s.out.mkdir(parents=True, exist_ok=True)
    payload = {"name": s.name, "settings": s.as_dict(), "machine": machine_info(s.device), "partial": partial,
               **payload}
    if partial:
        markdown = markdown.rstrip() + "\n\n(PARTIAL: the run stopped before finishing every size)\n"
    for suffix, text in ((".json", json.dumps(_jsonable(payload), indent=1) + "\n"), (".md", markdown.rstrip() + "\n")):
        tmp = s.out / f"{s.name}{suffix}.tmp"
        tmp.write_text(text)
        tmp.replace(s.out / f"{s.name}{suffix}")  # atomic: a reader never sees half a file
    if plot is not None and not partial:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            fig = plot(plt)
            fig.tight_layout()
            fig.savefig(s.out / f"{s.name}.png", dpi=110)
            plt.close(fig)
        except Exception as err:  # a plot must never lose the numbers
            print(f"{s.name}: plot failed: {err!r}", file=sys.stderr)
    return payload


def finish(s: Settings, report: Callable[[], tuple], plot: Callable, log: Callable[[str], None]) -> dict:
    """The last step of every benchmark: the final results files (``report() -> (payload, markdown)``,
    with the plot) and where they went."""
    payload = write_results(s, *report(), plot)
    log(f"wrote {s.out / s.name}.json/.md/.png")
    return payload


def fmt_bytes(b: float | None) -> str:
    if b is None or b != b:
        return "n/a"
    return f"{b / 2**20:,.0f} MiB" if b >= 2**20 else f"{b / 2**10:,.0f} KiB"


def fmt_ratio(st: dict) -> str:
    """``median [q1-q3]`` of a stats dict of plain ratios (x)."""
    return f"{st['median']:.2f}x [{st['q1']:.2f}-{st['q3']:.2f}]"


def speedup_targets(results: list, size_key: str, minimum: dict, what: str, is_cuda: bool) -> list[dict]:
    """Issue 35's GPU targets for the ConceptMoE's speedup over its matched MoE (``minimum``: size ->
    least speedup) on the rows of ``results`` at those sizes; value and verdict on a GPU only (None
    elsewhere: a CPU speedup says nothing about them)."""
    out = []
    for r in results:
        if "skipped" in r or r[size_key] not in minimum:
            continue
        low, v = minimum[r[size_key]], r["speedup"]["median_of_ratios"] if is_cuda else None
        out.append({"size": r[size_key], "batch": r.get("batch", 1), "what": f"GPU: {what} (>= {fmt_pct(low, 0)})",
                    "value": v, "met": None if v is None else v >= low})
    return out


def targets_md(targets: list) -> str:
    """The targets as markdown lines: value and met / MISSED / not measured on this device."""
    return "".join(f"- {t['what']}, {t['size']:,}, batch {t['batch']}: "
                   + ("n/a" if t["value"] is None else fmt_pct(t["value"])) + " -> "
                   + ("not measured on this device" if t["met"] is None else "met" if t["met"] else "MISSED") + "\n"
                   for t in targets)
