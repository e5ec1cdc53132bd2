"""Shared benchmark harness: side-by-side timing in one run, statistics, machine info, results files.

Why it looks like this: the machines these benchmarks run on are shared and noisy (a CI box, a
laptop, a 2-core VM with other jobs on it). Absolute latencies drift by tens of percent within a
minute, so every benchmark compares its variants IN THE SAME RUN, interleaved round by round
(A, B, then B, A, then A, B, ... : the order flips every round so that drift within a round does
not favour one variant), excludes warm-up rounds, and reports medians with the inter-quartile
range. Speedups are computed two ways and both are kept: the ratio of the medians, and the median
of the per-round ratios (each round's A and B ran back to back, so a slow phase of the machine
hits both). A figure quoted from these results should be a ratio, not a latency.

Conventions shared by every script:
- ``--device cpu|cuda``, ``--dtype float32|bfloat16|float16`` (default fp32 on CPU, bf16 on CUDA),
  ``--sizes`` (a preset name ``cpu``/``gpu``/``smoke`` or a comma list), ``--smoke`` (= ``--sizes
  smoke`` and minimal repetitions, for CI), ``--reps``, ``--warmup``, ``--threads``, ``--out``.
- ``torch.set_num_threads`` is fixed for the run and recorded (default "auto": 1 thread or all usable
  cores, whichever a short calibration finds faster: on an oversubscribed machine multi-threaded small
  ops are 10-100x slower than one thread).
- Each script writes ``<out>/<name>.json`` (machine, settings, raw times, derived figures),
  ``<out>/<name>.md`` (the table) and ``<out>/<name>.png`` (the plot).
- Speed comparisons of ConceptMoE use ``boundary_mode="fixed"`` (a boundary every round(R)
  tokens): the achieved ratio is exactly R and the compute is that of a learned router at ratio R.
  A randomly initialised dynamic router would give an arbitrary ratio (its p hovers near 0.5).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BENCH_CONFIGS = ROOT / "benchmarks" / "configs"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
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
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default=None, help="suffix of the results files (<name>_<tag>.json) for extra runs")
    return ap


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


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


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
    return Settings(full_name, device, dtype, preset, sizes, n_reps, warmup, threads, Path(args.out), args.seed,
                    bool(args.smoke), args)


_THREAD_CHOICE: dict = {}


def resolve_threads(spec, device: torch.device) -> int:
    """``--threads``: an int, or "auto" (cached per process, so every benchmark of a run agrees)."""
    if spec not in (None, "auto", "0", 0):
        return int(spec)
    cores = available_cores()
    if device.type == "cuda" or cores == 1:
        return cores
    if "auto" not in _THREAD_CHOICE:
        _THREAD_CHOICE["auto"] = choose_threads(cores)
    return _THREAD_CHOICE["auto"]["threads"]


def choose_threads(cores: int, rounds: int = 3) -> dict:
    """1 thread or all cores, whichever is faster on a small mixed workload (~1-2 s).

    On an oversubscribed machine (other jobs keep the load average above the core count) OpenMP's
    spinning barriers make multi-threaded small ops 10-100x slower than one thread, which would
    turn every small-op-heavy figure (decode, MoE dispatch) into noise; on an idle machine all
    cores win. The choice and its timings are recorded in the results (``machine.thread_choice``).
    """
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, 512, generator=g), torch.randn(512, 512, generator=g)
    xs = [torch.randn(64, 128, generator=g) for _ in range(8)]
    w = torch.randn(128, 128, generator=g)

    def work():
        torch.mm(a, b)
        for x in xs:  # small ops, as in MoE dispatch and decoding
            torch.nn.functional.silu(x @ w).sum()
    res = {1: [], cores: []}
    old = torch.get_num_threads()
    for r in range(rounds + 1):
        for n in ((1, cores) if r % 2 == 0 else (cores, 1)):
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            for _ in range(3):
                work()
            if r:
                res[n].append(time.perf_counter() - t0)
    torch.set_num_threads(old)
    med = {n: statistics.median(v) for n, v in res.items()}
    best = min(med, key=med.get)
    return {"threads": best, "calibration_s": {str(n): v for n, v in med.items()},
            "load_average": load_average()}


# ---------------------------------------------------------------------------------------------
# machine info
# ---------------------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> list:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "sse4")))
    except OSError:
        pass
    return []


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def load_average() -> list | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def machine_info(device: torch.device | None = None) -> dict:
    import transformers
    info = {"timestamp": _dt.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
            "platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu": _cpu_model(), "cpu_flags": _cpu_flags(),
            "logical_cpus": os.cpu_count(), "usable_cores": available_cores(),
            "torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
            "mkl": torch.backends.mkl.is_available(), "mkldnn": torch.backends.mkldnn.is_available(),
            "load_average_1_5_15": load_average(), "git": _git_commit(),
            "thread_choice": _THREAD_CHOICE.get("auto", "fixed by --threads")}
    try:
        info["mem_total_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    if device is not None and device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, gpu_mem_gb=round(p.total_memory / 2**30, 1), gpu_sm=p.multi_processor_count,
                    gpu_capability=f"{p.major}.{p.minor}", cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version(), tf32=torch.backends.cuda.matmul.allow_tf32)
    return info


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Wall-clock seconds of one call, the device drained before and after."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def stats(xs: list) -> dict:
    """Median and quartiles (inclusive method; n = 1 and 2 handled)."""
    xs = sorted(float(x) for x in xs)
    if not xs:
        return {"n": 0, "median": float("nan"), "q1": float("nan"), "q3": float("nan"), "iqr": float("nan"),
                "min": float("nan"), "max": float("nan")}
    if len(xs) == 1:
        q1 = q3 = xs[0]
    else:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    med = statistics.median(xs)
    return {"n": len(xs), "median": med, "q1": q1, "q3": q3, "iqr": q3 - q1, "min": xs[0], "max": xs[-1],
            "iqr_rel": (q3 - q1) / med if med else float("nan")}


@dataclass
class Comparison:
    """Times (seconds) per variant, one entry per timed round, in round order."""
    times: dict
    rounds: int
    warmup: int
    order: list = field(default_factory=list)  # the variant order of each timed round

    def stats(self, name: str, scale: float = 1.0) -> dict:
        return stats([t * scale for t in self.times[name]])

    def median(self, name: str) -> float:
        return statistics.median(self.times[name])

    def speedup(self, base: str, new: str) -> dict:
        """How much faster ``new`` is than ``base`` (t_base / t_new - 1), two estimators + per-round IQR."""
        tb, tn = self.times[base], self.times[new]
        per_round = [b / n for b, n in zip(tb, tn)]
        s = stats(per_round)
        return {"ratio_of_medians": statistics.median(tb) / statistics.median(tn) - 1,
                "median_of_ratios": s["median"] - 1, "ratio_q1": s["q1"] - 1, "ratio_q3": s["q3"] - 1,
                "per_round": [r - 1 for r in per_round]}


def interleaved(variants: dict, device: torch.device, reps: int, warmup: int = 1, inner: int = 1,
                between: Callable[[], None] | None = None, log: Callable[[str], None] | None = None) -> Comparison:
    """Run every variant once per round, ``warmup`` + ``reps`` rounds, the order reversed every round.

    ``variants``: name -> zero-argument callable. ``inner``: calls per measurement (the time is
    divided by it; use it for sub-millisecond work). ``between``: called (untimed) before each
    measurement, e.g. to reset a decode cache. Warm-up rounds are run in the same interleaved way
    and discarded.
    """
    names = list(variants)
    times = {n: [] for n in names}
    order_log = []
    for r in range(warmup + reps):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            if between is not None:
                between(n)
            fn = variants[n]

            def run(fn=fn):
                for _ in range(inner):
                    fn()
            t = time_once(run, device) / inner
            if r >= warmup:
                times[n].append(t)
        if r >= warmup:
            order_log.append(list(order))
        if log is not None:
            tag = "warm-up" if r < warmup else f"round {r - warmup + 1}/{reps}"
            log(f"  {tag}: " + ", ".join(f"{n} {times[n][-1] * 1e3:.2f} ms" if r >= warmup else n for n in order))
    return Comparison(times, reps, warmup, order_log)


# ---------------------------------------------------------------------------------------------
# matmul peak
# ---------------------------------------------------------------------------------------------
def matmul_peak_size(device: torch.device, dtype: torch.dtype, smoke: bool = False) -> int:
    if smoke:
        return 256
    return 8192 if device.type == "cuda" else 2048


def make_matmul(device: torch.device, dtype: torch.dtype, n: int) -> tuple[Callable[[], object], float]:
    """A square ``n x n`` matmul (the machine's practical peak for this dtype) and its FLOPs."""
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device, dtype)
    b = torch.randn(n, n, generator=g).to(device, dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)

    def fn():
        torch.mm(a, b, out=out)
    return fn, 2.0 * n ** 3


def measure_peak(device: torch.device, dtype: torch.dtype, reps: int = 5, n: int | None = None,
                 inner: int | None = None) -> dict:
    """Stand-alone peak measurement (benchmarks that can afford it interleave ``make_matmul`` instead)."""
    n = n or matmul_peak_size(device, dtype)
    fn, flops = make_matmul(device, dtype, n)
    inner = inner or (10 if device.type == "cuda" else 1)
    comp = interleaved({"matmul": fn}, device, reps=reps, warmup=1, inner=inner)
    s = comp.stats("matmul")
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "flops": flops, "seconds": s,
            "flops_per_s": flops / s["median"], "flops_per_s_best": flops / s["min"]}


# ---------------------------------------------------------------------------------------------
# model pair (plain MoE vs ConceptMoE matched by the accountant)
# ---------------------------------------------------------------------------------------------
MODEL_CONFIGS = ROOT / "configs" / "model"
PAIRS = {"cpu": BENCH_CONFIGS / "pair_cpu.yaml", "gpu": BENCH_CONFIGS / "pair_gpu.yaml",
         "smoke": BENCH_CONFIGS / "pair_smoke.yaml"}
# the project's GPU speed pair (configs/model/), preferred over pair_gpu.yaml when present
PROJECT_GPU_PAIR = (MODEL_CONFIGS / "bench_moe_top8.yaml", MODEL_CONFIGS / "bench_1l_top24_r2.yaml")


def resolve_pair(spec: str) -> str:
    """A preset name (cpu, gpu, smoke) or a path spec -> ``BASE.yaml[:CONCEPT.yaml]``."""
    if spec == "gpu" and PROJECT_GPU_PAIR[0].is_file():
        base, con = PROJECT_GPU_PAIR
        return f"{base}:{con}" if con.is_file() else str(base)
    return str(PAIRS.get(spec, spec))


def add_pair_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--pair", default=None,
                    help="baseline plain-MoE YAML or a preset name (cpu, gpu, smoke; default by --sizes); "
                         "BASE.yaml:CONCEPT.yaml uses a given ConceptMoE config instead of solving one")
    ap.add_argument("--ratio", type=float, default=2.0, help="target compression ratio R")
    ap.add_argument("--strategy", default="topk", help="accountant matching strategy (topk = paper strategy 1)")


def load_pair(spec: str, ratio: float = 2.0, strategy: str = "topk", seq_len: int = 8192,
              boundary_mode: str = "fixed", **overrides) -> tuple:
    """(baseline_cfg, concept_cfg, info). The ConceptMoE is solved by ``vlm.flops.solve_match``
    (FLOP- and parameter-matched to the baseline, 1 encoder and 1 decoder layer: the "1L" shape)
    unless ``spec`` names both configs. Both use ``boundary_mode`` (default fixed, see above)."""
    from vlm.config import ConceptMoEConfig
    path = resolve_pair(spec)
    concept_path = None
    if ":" in path:
        path, concept_path = path.split(":", 1)
    base = ConceptMoEConfig.from_yaml(path, **overrides)
    if base.chunking:
        raise SystemExit(f"{path}: the baseline of a pair must be a plain MoE (chunking off)")
    info = {"baseline_config": _rel(path)}
    if concept_path:
        con = ConceptMoEConfig.from_yaml(concept_path, boundary_mode=boundary_mode, **overrides)
        info["concept_config"] = _rel(concept_path)
        info["matching"] = "given"
    else:
        from vlm.flops import solve_match
        con = solve_match(base, strategy, ratio, encoder_layers=1, decoder_layers=1, seq_len=seq_len,
                          boundary_mode=boundary_mode)
        info["matching"] = dict(getattr(con, "solver_info", {}))
    info["boundary_mode"] = con.boundary_mode
    info.update(describe_pair(base, con, seq_len))
    return base, con, info


def _rel(path) -> str:
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


def describe_pair(base, con, seq_len: int) -> dict:
    from vlm.flops import count_params, describe, flops_per_token
    pb, pc = count_params(base), count_params(con)
    fb, fc = flops_per_token(base, seq_len), flops_per_token(con, seq_len)
    return {"baseline": describe(base), "concept": describe(con),
            "params_baseline": pb["total"], "params_concept": pc["total"],
            "param_diff": pc["total"] / pb["total"] - 1,
            "flops_no_attn_map_baseline": fb["total_no_attn_map"], "flops_no_attn_map_concept": fc["total_no_attn_map"],
            "flop_diff_no_attn_map": fc["total_no_attn_map"] / fb["total_no_attn_map"] - 1,
            "concept_top_k": con.concept_top_k, "top_k": base.top_k, "layers": base.num_hidden_layers,
            "split": f"{con.encoder_layers}/{con.concept_layers}/{con.decoder_layers}"}


def predicted_speedup(base, con, seq_len: int, ratio: float | None = None, causal_half: bool = False) -> float:
    """Accountant's forward FLOPs per token (attention map included) baseline / ConceptMoE - 1."""
    from vlm.flops import flops_per_token
    fb = flops_per_token(base, seq_len, causal_half=causal_half)["total"]
    fc = flops_per_token(con, seq_len, ratio=ratio, causal_half=causal_half)["total"]
    return fb / fc - 1


def build_model(cfg, device: torch.device, dtype: torch.dtype, seed: int = 0, train: bool = False):
    from vlm.modeling.hf import ConceptMoEForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the device (a 1B+ model's CPU init takes long)
        model = ConceptMoEForCausalLM(cfg)
    return model.to(dtype=dtype).train(train)


def random_ids(batch: int, length: int, vocab: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(1, vocab, (batch, length), generator=g).to(device)


def free_memory(device: torch.device) -> None:
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_memory_gb(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    except ImportError:
        return None


# ---------------------------------------------------------------------------------------------
# results files
# ---------------------------------------------------------------------------------------------
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


def logger(s: Settings) -> Callable[[str], None]:
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{s.name} {time.perf_counter() - t0:7.1f}s] {msg}", flush=True)
    return log
