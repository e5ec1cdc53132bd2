"""Controlled comparison: plain MoE vs ConceptMoE (dynamic / fixed chunking, looping) at equal
activated FLOPs and equal total parameters, same data order, same token budget.

    python -m vlm.compare --config configs/compare/cpu.yaml [--seeds N] [--out DIR] [key=value ...]
    python -m vlm.compare --config configs/compare/cpu.yaml --dry-run       # presets + FLOPs table only
    python -m vlm.compare --config configs/compare/cpu.yaml --write-presets # re-solve configs/model/cmp_*

What it does (paper sections 7-8, see docs/conceptmoe.md):
1. Builds the plain-MoE baseline language model of the compare YAML (``baseline``; its vocabulary
   size is taken from the tokenizer so the accounting is that of the trained model) and solves
   each ConceptMoE arm against it with ``vlm.flop_matching.solve_match`` (strategy ``topk`` = 1,
   ``loop`` = 2, ``wide`` = 3). The language-model presets are written with the solver's YAML
   writer as ``configs/model/<prefix>_<arm>_lm.yaml`` and the VLM presets (shared vision tower +
   projector, ``text_preset:`` the LM preset, plus the arm's ``text:`` overrides, e.g.
   ``boundary_mode: fixed``) as ``configs/model/<prefix>_<arm>.yaml``. Existing presets are
   checked against a fresh solve: a stale one is an error (``--write-presets`` rewrites it).
2. Trains every arm for every seed with the project's ``Trainer`` on the same training YAML (the
   compare YAML's ``train_base`` + ``train``): same steps, micro-batch, sequence length and data
   seed, so the same sample order and token budget (checked: a fingerprint of every batch's token
   ids is recorded per run and must agree across the arms of a seed). Seed s sets both the data
   order and the initialisation: arms of one seed are paired.
3. Evaluates the exported HF model: held-out digits VQA (the trainer's ``eval`` section, with the
   achieved compression ratio on the prompts, pooled and per modality) and held-out text
   (``eval_suites.text_eval``: loss per token, bits per byte, achieved ratio) on a bounded number
   of tokens.
4. Writes ``<out>/report.md`` + ``report.json`` + ``loss_curves.png`` (``vlm/compare_report.py``).

Runs are resumable: an arm/seed whose ``compare_result.json`` carries the same job key (train
config + eval settings + preset texts) is reused, so ``--seeds 3`` after a 1-seed run trains only
the new seeds (``--fresh`` retrains everything; the key does not cover code changes). ``jobs: N``
(or ``--jobs``) trains N arms at once in subprocesses (``threads`` torch threads each); ``jobs: 1``
trains them one after the other in this process, or each in its own subprocess with
``isolate: true`` (GPU: a fresh CUDA context per arm).

Compare YAML keys (see configs/compare/cpu.yaml for a commented example): name, output_dir, seed,
seeds, jobs, threads, isolate, preset_prefix, train_base, train (train-YAML keys; model.* is owned
by the arms), vlm (vision / projector / text shared by all arms), baseline (preset and/or lm
sections of arm a's language model), match (solve_match options), arms (id, name, label, solve:
null|topk|loop|wide, solve_opts, same_as: an earlier arm's LM, text: VLM text overrides), eval
(text, text_max_tokens, text_seq_len, text_batch_size, dtype, keep_hf).
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
PRESET_DIR = REPO_ROOT / "configs" / "model"
STRATEGIES = ("topk", "loop", "wide")
TOP_KEYS = {"name", "output_dir", "seed", "seeds", "jobs", "threads", "isolate", "preset_prefix", "train_base", "train",
            "vlm", "baseline", "match", "arms", "eval"}
ARM_KEYS = {"id", "name", "label", "solve", "solve_opts", "same_as", "text"}
MATCH_KEYS = {"ratio", "seq_len", "encoder_layers", "decoder_layers", "joint_decoding_layers", "concept_merge",
              "overrides"}
EVAL_DEFAULTS = {"text": "data/default/shakespeare_val.txt", "text_max_tokens": 8192, "text_seq_len": None,
                 "text_batch_size": 16, "dtype": "float32", "keep_hf": True}
VLM_KEYS = {"vision", "projector", "text"}


class CompareError(ValueError):
    """A bad compare config; one line."""


def _err(key: str, msg: str) -> CompareError:
    return CompareError(f"compare config error: {key}: {msg}")


def _path(p) -> Path:
    p = Path(p)
    return p if p.is_absolute() else REPO_ROOT / p


def _rel(p: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(p)


# --- config ------------------------------------------------------------------------------------
def load_compare(path, overrides=()) -> dict:
    from vlm.training.train_config import parse_override, set_dotted

    path = _path(path)
    if not path.is_file():
        raise CompareError(f"compare config error: file not found: {path}")
    raw = yaml.safe_load(path.read_text()) or {}
    for text in overrides:
        key, val = parse_override(text)
        set_dotted(raw, key, val)
    for key in raw:
        if key not in TOP_KEYS:
            raise _err(key, f"unknown key (known: {', '.join(sorted(TOP_KEYS))})")
    cfg = {"name": path.stem, "output_dir": "runs/compare", "seed": 0, "seeds": 1, "jobs": 1, "threads": None,
           "isolate": False, "preset_prefix": None, "train_base": "configs/train/default.yaml", "train": {},
           "vlm": {}, "baseline": {}, "match": {}, "arms": [], "eval": {}, **raw, "source": _rel(path)}
    cfg["preset_prefix"] = cfg["preset_prefix"] or f"cmp_{cfg['name']}"
    cfg["eval"] = {**EVAL_DEFAULTS, **(cfg["eval"] or {})}
    for key in cfg["eval"]:
        if key not in EVAL_DEFAULTS:
            raise _err(f"eval.{key}", f"unknown key (known: {', '.join(EVAL_DEFAULTS)})")
    for key in cfg["match"]:
        if key not in MATCH_KEYS:
            raise _err(f"match.{key}", f"unknown key (known: {', '.join(sorted(MATCH_KEYS))})")
    for key in cfg["vlm"]:
        if key not in VLM_KEYS:
            raise _err(f"vlm.{key}", f"unknown key (known: {', '.join(sorted(VLM_KEYS))})")
    model = (cfg["train"] or {}).get("model") or {}
    for key in model:
        if key not in ("kind", "tokenizer"):
            raise _err(f"train.model.{key}", "the arms define the model; only model.tokenizer may be set here")
    for key in ("seeds", "jobs"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise _err(key, f"must be an integer >= 1, got {cfg[key]!r}")
    arms, ids = [], set()
    for i, arm in enumerate(cfg["arms"]):
        for key in arm:
            if key not in ARM_KEYS:
                raise _err(f"arms[{i}].{key}", f"unknown key (known: {', '.join(sorted(ARM_KEYS))})")
        arm = {"label": arm.get("name"), "solve": None, "solve_opts": {}, "same_as": None, "text": {}, **arm}
        if "id" not in arm or "name" not in arm:
            raise _err(f"arms[{i}]", "needs an id and a name")
        if arm["solve"] is not None and arm["solve"] not in STRATEGIES:
            raise _err(f"arms[{i}].solve", f"must be null or one of {STRATEGIES}, got {arm['solve']!r}")
        if arm["same_as"] is not None and (arm["same_as"] not in ids or arm["solve"]):
            raise _err(f"arms[{i}].same_as", "must name an EARLIER arm (and the arm must not also solve)")
        ids.add(arm["id"])
        arms.append(arm)
    if not arms or arms[0]["solve"] or arms[0]["same_as"]:
        raise _err("arms", "the first arm must be the plain-MoE baseline (no solve, no same_as)")
    if len({a["name"] for a in arms}) != len(arms):
        raise _err("arms", "arm names must be unique")
    cfg["arms"] = arms
    return cfg


def train_raw(cfg: dict) -> dict:
    """The training YAML shared by every arm (``train_base`` deep-merged with ``train``)."""
    from vlm.training.train_config import deep_merge, read_yaml

    return deep_merge(read_yaml(_path(cfg["train_base"])), cfg["train"] or {})


def _seq_len(cfg: dict, raw: dict) -> int:
    if cfg["match"].get("seq_len"):
        return int(cfg["match"]["seq_len"])
    data = raw.get("data") or {}
    if data.get("max_length"):
        return int(data["max_length"])
    if data.get("config"):
        return int((yaml.safe_load(_path(data["config"]).read_text()) or {}).get("max_length") or 128)
    return 64


def _tokenizer_vocab(raw: dict) -> int | None:
    tok = (raw.get("model") or {}).get("tokenizer")
    if not tok or not _path(tok).is_dir():
        return None
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(_path(tok))))


# --- presets -----------------------------------------------------------------------------------
def baseline_config(cfg: dict, vocab: int | None):
    from vlm.config import ConceptMoEConfig, load_yaml
    from vlm.training.train_config import deep_merge

    base = cfg["baseline"] or {}
    raw = load_yaml(_path(base["preset"])) if base.get("preset") else {}
    raw = deep_merge(raw, base.get("lm") or {})
    over = {"vocab_size": vocab} if vocab else {}
    lm = ConceptMoEConfig.from_dict_sections(raw, over)
    if lm.chunking:
        raise _err("baseline", "the baseline (arm a) must be a plain MoE (chunking off)")
    return lm


def _vlm_text(cfg: dict, arm: dict, lm_file: str, header: list[str]) -> str:
    from vlm.flop_matching import _dump
    from vlm.training.train_config import deep_merge

    v = cfg["vlm"]
    text = deep_merge(v.get("text") or {}, arm["text"] or {})
    out = "".join(f"# {line}\n" for line in header)
    for key in ("vision", "projector"):
        if v.get(key):
            out += f"{key}: {_dump(v[key])}\n"
    out += f"text_preset: {lm_file}\n"
    if text:
        out += f"text: {_dump(text)}\n"
    return out


def build_presets(cfg: dict, raw: dict, mode: str = "create", preset_dir: Path = PRESET_DIR) -> dict:
    """Solve every arm; return {arm id: {lm_cfg, lm_path, vlm_path, solver_info, text}}.

    ``mode``: "create" writes missing presets and refuses stale ones (a preset that differs from the
    fresh solve), "write" (re)writes every preset that differs, "check" writes nothing and refuses
    missing or stale presets."""
    import tempfile

    from vlm.flop_matching import solve_match, solve_report, write_yaml
    from vlm.flops import describe

    seq_len = _seq_len(cfg, raw)
    vocab = _tokenizer_vocab(raw)
    base = baseline_config(cfg, vocab)
    m = cfg["match"]
    ratio = float(m.get("ratio", 2.0))
    cmd = f"python -m vlm.compare --config {cfg['source']} --write-presets"
    prefix, out, texts = cfg["preset_prefix"], {}, {}
    for arm in cfg["arms"]:
        lm_name = f"{prefix}_{arm['name']}_lm.yaml"
        if arm["same_as"]:
            src = out[arm["same_as"]]
            lm_cfg, lm_name, info = src["lm_cfg"], src["lm_path"].name, src["solver_info"]
        elif arm["solve"] is None:
            lm_cfg, info = base, None
            header = (f"{lm_name[:-5]}: arm {arm['id']} ({arm['label']}) of {cfg['source']}: the plain-MoE "
                      f"baseline every other arm is matched to. Generated, do not edit: `{cmd}`.")
            notes = describe(base) + f"; vocab {base.vocab_size} (from the tokenizer)"
            texts[lm_name] = (lm_cfg, header, notes)
        else:
            opts = {"encoder_layers": m.get("encoder_layers"), "decoder_layers": m.get("decoder_layers"),
                    "joint_decoding_layers": m.get("joint_decoding_layers", 4), "seq_len": seq_len,
                    "concept_merge": m.get("concept_merge"), **(m.get("overrides") or {}), **(arm["solve_opts"] or {})}
            lm_cfg = solve_match(base, arm["solve"], ratio, **opts)
            info = lm_cfg.solver_info
            header = (f"{lm_name[:-5]}: arm {arm['id']} ({arm['label']}) of {cfg['source']}: ConceptMoE R={ratio:g} "
                      f"matched to {prefix}_{cfg['arms'][0]['name']}_lm.yaml by strategy {arm['solve']} "
                      f"(vlm.flop_matching, N={seq_len}). Generated, do not edit.")
            notes = solve_report(base, lm_cfg, arm["solve"], seq_len, ratio, command=cmd)
            texts[lm_name] = (lm_cfg, header, notes)
        vlm_name = f"{prefix}_{arm['name']}.yaml"
        vlm_header = [(f"{vlm_name[:-5]}: VLM of arm {arm['id']} ({arm['label']}) of {cfg['source']}; vision tower "
                       "and projector shared by all arms."), f"Generated, do not edit: `{cmd}`."]
        texts[vlm_name] = _vlm_text(cfg, arm, lm_name, vlm_header)
        out[arm["id"]] = {"lm_cfg": lm_cfg, "lm_path": preset_dir / lm_name, "vlm_path": preset_dir / vlm_name,
                          "solver_info": info}
    with tempfile.TemporaryDirectory() as tmp:
        for fname, spec in texts.items():
            if isinstance(spec, tuple):
                write_yaml(spec[0], Path(tmp) / fname, header=spec[1], notes=spec[2])
                text = (Path(tmp) / fname).read_text()
            else:
                text = spec
            target = preset_dir / fname
            if target.is_file() and target.read_text() == text:
                continue
            if mode == "check" or (target.is_file() and mode != "write"):
                what = "differs from" if target.is_file() else "is missing for"
                raise CompareError(f"compare: {_rel(target)} {what} a fresh solve of {cfg['source']} "
                                   f"(config or solver changed?); rerun with --write-presets to rewrite it")
            target.write_text(text)
            print(f"[compare] wrote {_rel(target)}", flush=True)
    for spec in out.values():  # the VLM preset text (part of the job key)
        spec["text"] = spec["vlm_path"].read_text()
    return out


# --- jobs --------------------------------------------------------------------------------------
def out_dir(cfg: dict, override: str | None = None) -> Path:
    return Path(override) if override else _path(cfg["output_dir"]) / cfg["name"]


def make_jobs(cfg: dict, raw: dict, presets: dict, out: Path, seeds: list[int]) -> list[dict]:
    from vlm.training.train_config import deep_merge

    jobs = []
    for seed in seeds:
        for arm in cfg["arms"]:
            p = presets[arm["id"]]
            name = f"{arm['name']}-s{seed}"
            train = deep_merge(raw, {"name": name, "output_dir": str(out / "runs"), "seed": int(seed),
                                     "model": {"kind": "vlm", "preset": str(p["vlm_path"])}})
            train.pop("base", None)
            if cfg["threads"] and _train_has("cpu_threads"):
                train["cpu_threads"] = int(cfg["threads"])  # the trainer's own knob (process-wide)
            key_src = json.dumps({"train": train, "eval": cfg["eval"], "vlm": p["text"],
                                  "lm": p["lm_path"].read_text()}, sort_keys=True, default=str)
            jobs.append({"arm": arm["id"], "arm_name": arm["name"], "seed": int(seed), "train": train,
                         "eval": cfg["eval"], "threads": cfg["threads"], "run_dir": str(out / "runs" / name),
                         "key": hashlib.sha1(key_src.encode()).hexdigest()[:16]})
    return jobs


def _train_has(key: str) -> bool:
    import dataclasses

    from vlm.training.train_config import TrainConfig

    return key in {f.name for f in dataclasses.fields(TrainConfig)}


class _FingerprintLoader:
    """Wraps the trainer's loader: hashes the token ids of every batch it yields (same data order
    across arms <=> same fingerprint) and delegates everything else."""

    def __init__(self, loader):
        self._loader, self._hash, self.batches = loader, hashlib.sha1(), 0

    def __iter__(self):
        for batch in self._loader:
            ids = batch.get("input_ids")
            if ids is not None:
                self._hash.update(ids.cpu().numpy().tobytes())
            self.batches += 1
            yield batch

    def __getattr__(self, name):
        return getattr(self._loader, name)

    @property
    def digest(self) -> str:
        return self._hash.hexdigest()[:16]


def run_job(job: dict) -> dict:
    """Train + export + evaluate one arm/seed in this process; writes <run>/compare_result.json."""
    import torch

    sys.modules.setdefault("wandb", None)  # timm imports wandb only to offer it (slow); see vlm/train.py
    threads_before, omp_before = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    try:
        if job.get("threads"):
            os.environ["OMP_NUM_THREADS"] = str(job["threads"])  # keeps init_distributed's own choice off
            torch.set_num_threads(int(job["threads"]))
        return _run_job(job)
    finally:  # an in-process caller (a test session) gets its thread settings back
        torch.set_num_threads(threads_before)
        if omp_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = omp_before


def _run_job(job: dict) -> dict:
    import gc

    import torch

    from eval_suites.text_eval import evaluate_text
    from vlm.training.train_config import load_train_config
    from vlm.training.trainer import Trainer

    t0 = time.time()
    tcfg = load_train_config(raw=copy.deepcopy(job["train"]))
    trainer = Trainer(tcfg)
    fp = _FingerprintLoader(trainer.loader)
    trainer.loader = fp
    try:
        trainer.fit()
        fingerprint = f"{fp.digest}/{fp.batches}"
        fin = trainer.finish()
    finally:
        trainer.close()
    ev, e = fin.get("eval") or {}, job["eval"]
    counts = dict(trainer.total_counts)
    rec = {k: v for k, v in trainer.last_record.items() if k != "expert_load"}
    run_dir = Path(job["run_dir"])
    hf = run_dir / "hf"
    device = "cuda" if trainer.device == "cuda" else "cpu"
    seq_len = int(e["text_seq_len"] or tcfg.data.max_length or 128)
    del trainer, fp
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    text = None
    if e.get("text") and (hf / "config.json").is_file():
        text = evaluate_text(str(hf), str(_path(e["text"])), seq_len, int(e["text_batch_size"]),
                             int(e["text_max_tokens"]), tcfg.model.tokenizer and str(_path(tcfg.model.tokenizer)),
                             e["dtype"], device)
    if not e.get("keep_hf", True) and hf.is_dir():
        import shutil

        shutil.rmtree(hf, ignore_errors=True)
    result = {"arm": job["arm"], "arm_name": job["arm_name"], "seed": job["seed"], "key": job["key"],
              "run_dir": job["run_dir"], "params_measured": counts, "last_train_record": rec,
              "tokens_seen": int(rec.get("tokens_seen", 0)), "steps": int(rec.get("step", 0)),
              "data_fingerprint": fingerprint,
              "vqa": {k: ev[k] for k in ("accuracy", "correct", "total", "by_kind", "ratio", "ratio_image",
                                         "ratio_text", "eval_time_s") if k in ev} or None,
              "text": text, "wall_s": round(time.time() - t0, 2)}
    summary = run_dir / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        result["train_time_s"] = s.get("train_time_s")
    (run_dir / "compare_result.json").write_text(json.dumps(result, indent=1))
    return result


def _done(job: dict) -> dict | None:
    path = Path(job["run_dir"]) / "compare_result.json"
    if path.is_file():
        try:
            res = json.loads(path.read_text())
        except json.JSONDecodeError:
            return None
        if res.get("key") == job["key"]:
            return res
    return None


def run_jobs(jobs: list[dict], n_parallel: int, fresh: bool = False, isolate: bool = False) -> list[dict]:
    """Run (or reuse) every job; in this process one after the other when ``n_parallel`` is 1 and not
    ``isolate``, else in up to ``n_parallel`` subprocesses (``python -m vlm.compare --worker``)."""
    results: dict[int, dict] = {}
    todo = []
    for i, job in enumerate(jobs):
        prev = None if fresh else _done(job)
        if prev is not None:
            print(f"[compare] reusing {job['arm_name']} seed {job['seed']} ({job['run_dir']})", flush=True)
            results[i] = prev
        else:
            todo.append(i)
    if n_parallel <= 1 and not isolate:
        for i in todo:
            job = jobs[i]
            print(f"[compare] training arm {job['arm']} ({job['arm_name']}) seed {job['seed']}", flush=True)
            t = time.time()
            results[i] = run_job(job)
            print(f"[compare] arm {job['arm']} seed {job['seed']} done in {time.time() - t:.0f} s", flush=True)
        return [results[i] for i in range(len(jobs))]
    running: list = []
    pending = list(todo)
    failed = []
    while pending or running:
        while pending and len(running) < n_parallel:
            i = pending.pop(0)
            job = jobs[i]
            run_dir = Path(job["run_dir"])
            run_dir.mkdir(parents=True, exist_ok=True)
            spec = run_dir / "compare_job.json"
            spec.write_text(json.dumps(job, indent=1))
            env = dict(os.environ)
            if job.get("threads"):
                env["OMP_NUM_THREADS"] = str(job["threads"])
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                env.pop(k, None)
            log = open(run_dir / "compare_log.txt", "w")  # noqa: SIM115 - closed when the process ends
            proc = subprocess.Popen([sys.executable, "-m", "vlm.compare", "--worker", str(spec)], cwd=REPO_ROOT,
                                    env=env, stdout=log, stderr=subprocess.STDOUT)
            print(f"[compare] started arm {job['arm']} ({job['arm_name']}) seed {job['seed']} (pid {proc.pid}, "
                  f"log {_rel(run_dir / 'compare_log.txt')})", flush=True)
            running.append((i, proc, log, time.time()))
        time.sleep(2)
        for item in list(running):
            i, proc, log, t = item
            if proc.poll() is None:
                continue
            running.remove(item)
            log.close()
            job = jobs[i]
            res = _done(job)
            if proc.returncode != 0 or res is None:
                failed.append(f"{job['arm_name']} seed {job['seed']} (exit {proc.returncode}, see "
                              f"{job['run_dir']}/compare_log.txt)")
                print(f"[compare] FAILED {failed[-1]}", flush=True)
            else:
                results[i] = res
                print(f"[compare] arm {job['arm']} seed {job['seed']} done in {time.time() - t:.0f} s", flush=True)
    if failed:
        raise RuntimeError("compare: runs failed: " + "; ".join(failed))
    return [results[i] for i in range(len(jobs))]


# --- CLI ---------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vlm.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="compare YAML (configs/compare/*.yaml)")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (seed, seed+1, ...); default: the YAML's")
    p.add_argument("--out", default=None, help="output folder (default <output_dir>/<name>)")
    p.add_argument("--jobs", type=int, default=None, help="arms trained at once (subprocesses); 1 = in process")
    p.add_argument("--arms", default=None, help="comma-separated arm ids to run (default: all)")
    p.add_argument("--write-presets", action="store_true",
                   help="rewrite configs/model/<prefix>_*.yaml from a fresh solve")
    p.add_argument("--dry-run", action="store_true", help="solve/check the presets, write the FLOPs table, no training")
    p.add_argument("--fresh", action="store_true", help="retrain even where a finished run with the same key exists")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides of the compare YAML")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.worker:
        run_job(json.loads(Path(args.worker).read_text()))
        return 0
    if not args.config:
        print("error: --config is required", file=sys.stderr)
        return 2
    from vlm.compare_report import write_report
    from vlm.config import ConfigError

    t0 = time.time()
    config = Path(args.config).resolve() if Path(args.config).is_file() else _path(args.config)
    out_arg = str(Path(args.out).resolve()) if args.out else None
    if Path.cwd().resolve() != REPO_ROOT:  # train / data / tokenizer paths are relative to the repo root
        os.chdir(REPO_ROOT)
    try:
        cfg = load_compare(config, args.overrides)
        if args.seeds is not None:
            cfg["seeds"] = args.seeds
        if args.arms:
            keep = set(args.arms.split(","))
            if cfg["arms"][0]["id"] not in keep:
                raise CompareError("compare: --arms must include the baseline arm")
            cfg["arms"] = [a for a in cfg["arms"] if a["id"] in keep]
            for a in cfg["arms"]:
                if a["same_as"] and a["same_as"] not in keep:
                    raise CompareError(f"compare: --arms: arm {a['id']} reuses arm {a['same_as']}'s model; keep both")
        raw = train_raw(cfg)
        presets = build_presets(cfg, raw, mode="write" if args.write_presets else "create")
    except (CompareError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    out = out_dir(cfg, out_arg)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [cfg["seed"] + i for i in range(cfg["seeds"])]
    jobs = make_jobs(cfg, raw, presets, out, seeds)
    results = [] if args.dry_run else run_jobs(jobs, args.jobs or cfg["jobs"], fresh=args.fresh,
                                                  isolate=bool(cfg["isolate"]))
    report = write_report(cfg, raw, presets, results, out, seq_len=_seq_len(cfg, raw), seeds=seeds,
                          wall_s=time.time() - t0)
    print(report["markdown_tables"], flush=True)
    print(f"[compare] report: {_rel(out / 'report.md')} ({time.time() - t0:.0f} s)", flush=True)
    return 0 if report["match_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
