"""The GPU check's verdicts on each fast path (``gpu_verdicts.json``): ``auto`` on CUDA takes a new path
only where its entry says ``correct`` and ``faster`` (both measured true); null = not measured.

``scripts/gpu/verdicts.py`` (a step of scripts/gpu_check.sh) runs each new path beside its reference and
writes a measured file plus the markdown table of ``render``; committing that file here flips the defaults.
Readers: ``runtime.py`` (capacity T, the Triton EMA scan), ``fused_kernels.py`` (the fused kernels)."""
from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

FILE = Path(__file__).with_name("gpu_verdicts.json")
# path -> (what it is, the reference it is checked against)
PATHS = {
    "ema_scan_triton": ("dechunk EMA scan: Triton kernel (runtime.ema_scan)", "torch chunked scan"),
    "capacity_tokens": ("concept sequence at capacity T (runtime.capacity)", "exact count (one device read)"),
    "decode_cudagraph": ("decode step captured as CUDA graphs (generate(decode='cudagraph'))", "decode='static'"),
    "fused_cross_entropy_liger": ("liger fused linear CE (train.fused_kernels.cross_entropy)", "chunked_lm_loss"),
    "fused_rms_norm_liger": ("liger RMSNorm (train.fused_kernels.rms_norm)", "rms_norm.rms_norm"),
    "fused_swiglu_triton": ("Triton expert SwiGLU (train.fused_kernels.swiglu)", "GroupedSwiGLU"),
}
FIELDS = ("correct", "faster", "measured_on", "source")


@lru_cache(maxsize=4)
def load(path: str | None = None) -> dict:
    """The verdict table ``{"paths": {name: {correct, faster, measured_on, source}}}``; every name of
    ``PATHS`` must be there (a malformed or named but missing file is one error line). The shipped file
    missing (the code copied without it: a remote-code export) reads as nothing measured, said in the log."""
    if path is None and not FILE.is_file():
        log.warning("gpu verdicts: no %s beside the code; auto keeps the reference paths", FILE.name)
        return unmeasured()
    path = Path(path) if path else FILE
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"gpu verdicts {path}: cannot read: {err}") from None
    check_table(table, str(path))
    return table


def check_table(table: dict, where: str = "gpu verdicts") -> None:
    paths = table.get("paths") if isinstance(table, dict) else None
    if not isinstance(paths, dict) or set(paths) != set(PATHS):
        raise ValueError(f"{where}: 'paths' must hold exactly {sorted(PATHS)}")
    for name, entry in paths.items():
        if not isinstance(entry, dict) or set(entry) != set(FIELDS):
            raise ValueError(f"{where}: paths.{name} must hold exactly {list(FIELDS)}")
        for key in ("correct", "faster"):
            if entry[key] not in (True, False, None):
                raise ValueError(f"{where}: paths.{name}.{key} must be true, false or null, got {entry[key]!r}")


def proven(name: str, table: dict | None = None) -> bool:
    """Whether the GPU check measured path ``name`` correct and faster than its reference."""
    if name not in PATHS:
        raise ValueError(f"gpu verdicts: unknown path {name!r}: use one of {sorted(PATHS)}")
    entry = (table if table is not None else load())["paths"][name]
    return entry["correct"] is True and entry["faster"] is True


def _cell(value) -> str:
    return "not measured" if value is None else ("yes" if value else "no")


def render(table: dict) -> str:
    """The markdown verdict table: path x correct / faster / default of ``auto`` on CUDA."""
    check_table(table)
    rows = ["| path | reference | correct | faster | `auto` on CUDA | measured on |",
            "|---|---|---|---|---|---|"]
    for name, (what, ref) in PATHS.items():
        e = table["paths"][name]
        default = "new path" if proven(name, table) else "reference"
        rows.append(f"| `{name}`: {what} | {ref} | {_cell(e['correct'])} | {_cell(e['faster'])} | {default} "
                    f"| {e['measured_on'] or 'not measured'} |")
    return "\n".join(rows) + "\n"


def unmeasured() -> dict:
    """A table with every verdict null (what a CPU run of the check writes)."""
    return {"paths": {name: {"correct": None, "faster": None, "measured_on": None, "source": "scripts/gpu/verdicts.py"}
                      for name in PATHS}}
