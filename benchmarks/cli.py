"""Command line shared by every benchmark script, and the run settings it resolves to (threads, seed, dtype)."""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from benchmarks import ROOT
from benchmarks.machine import resolve_threads

RESULTS = ROOT / "benchmarks" / "results"  # the recorded figures (README, docs): written only with --record
SCRATCH = ROOT / "runs" / "bench"  # where a run writes by default, leaving the recorded figures as they are
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def base_parser(name: str, doc: str, size_help: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=doc)
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on CUDA)")
    ap.add_argument("--sizes", default=None, help=f"preset (cpu, gpu, smoke) or comma list: {size_help}")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and 1 repetition (CI, seconds)")
    ap.add_argument("--reps", type=int, default=None, help="timed rounds per size (default per preset)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed rounds per size (default 1)")
    ap.add_argument("--threads", default="auto",
                    help="torch.set_num_threads: a number, or auto (default: 1 or all usable cores, whichever "
                         "runs a short calibration faster; see choose_threads)")
    add_out_args(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default=None, help="suffix of the results files (<name>_<tag>.json) for extra runs")
    return ap


def add_out_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default=None, help="results folder (default runs/bench/)")
    ap.add_argument("--record", action="store_true",
                    help="write the recorded figures, benchmarks/results/ (what README and docs quote)")


def out_dir(args: argparse.Namespace) -> Path:
    """``--out``, else ``benchmarks/results`` with ``--record``, else ``runs/bench``."""
    if args.out is not None and args.record:
        raise SystemExit("error: give --out DIR or --record, not both")
    return Path(args.out) if args.out is not None else (RESULTS if args.record else SCRATCH)


@dataclass
class Settings:
    name: str
    device: torch.device
    dtype: torch.dtype
    preset: str  # cpu | gpu | smoke | custom
    sizes: list
    reps: int
    warmup: int
    threads: int
    out: Path
    seed: int
    smoke: bool
    args: argparse.Namespace = None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def as_dict(self) -> dict:
        return {"device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""), "preset": self.preset,
                "sizes": self.sizes, "reps": self.reps, "warmup": self.warmup, "threads": self.threads,
                "seed": self.seed, "smoke": self.smoke}


def parse_sizes(text: str | None, presets: dict, default: str) -> tuple[str, list]:
    """``text`` is a preset name or a comma list; list items are ints (``1K``/``16K`` allowed) or words."""
    if text is None:
        text = default
    if text in presets:
        return text, list(presets[text])
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        mult = 1
        if item[-1] in "kK" and item[:-1].isdigit():
            item, mult = item[:-1], 1024
        out.append(int(item) * mult if item.lstrip("-").isdigit() else item)
    return "custom", out


def setup(name: str, args: argparse.Namespace, presets: dict, reps: dict) -> Settings:
    """Fix threads, seeds and precision settings; resolve the size preset. ``reps``: preset -> rounds."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{name}: --device {args.device} but CUDA is not available")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # set_device needs an index
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    default = "smoke" if args.smoke else ("gpu" if device.type == "cuda" else "cpu")
    preset, sizes = parse_sizes("smoke" if args.smoke and args.sizes is None else args.sizes, presets, default)
    key = preset if preset in reps else default
    n_reps = args.reps if args.reps is not None else (1 if args.smoke else reps.get(key, 3))
    warmup = args.warmup if args.warmup is not None else 1
    threads = resolve_threads(args.threads, device)
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores (reported)
        torch.backends.cudnn.allow_tf32 = True
    full_name = f"{name}_{args.tag}" if getattr(args, "tag", None) else name
    return Settings(full_name, device, dtype, preset, sizes, n_reps, warmup, threads, out_dir(args), args.seed,
                    bool(args.smoke), args)


def logger(s: Settings) -> Callable[[str], None]:
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{s.name} {time.perf_counter() - t0:7.1f}s] {msg}", flush=True)
    return log
