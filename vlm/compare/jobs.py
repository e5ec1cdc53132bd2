"""The compare runs: one job per arm and seed (a training YAML + a key that decides reuse),
trained in this process or in subprocesses, then evaluated on the held-out splits; the batch
fingerprint that proves every arm of a seed saw the same data."""
from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from vlm.compare.config import REPO_ROOT, rel, repo_path
from vlm.modeling.config_base import deep_merge

REPORT_ONLY_EVAL = ("image_use",)  # eval knobs read by the report alone: a run trained without them is reused


# --- jobs --------------------------------------------------------------------------------------
def out_dir(cfg: dict, override: str | None = None) -> Path:
    return Path(override) if override else repo_path(cfg["output_dir"]) / cfg["name"]


def make_jobs(cfg: dict, raw: dict, presets: dict, out: Path, seeds: list[int]) -> list[dict]:
    jobs = []
    for seed in seeds:
        for arm in cfg["arms"]:
            p = presets[arm["id"]]
            name = f"{arm['name']}-s{seed}"
            train = deep_merge(raw, {"name": name, "output_dir": str(out / "runs"), "seed": int(seed),
                                     "model": {"kind": "vlm", "preset": str(p["vlm_path"])}})
            train.pop("base", None)
            if cfg["threads"]:
                train["cpu_threads"] = int(cfg["threads"])  # the trainer's own knob (process-wide)
            first = first_stage(cfg, train)
            if first is not None:
                train["model"]["init_from"] = str(out / "runs" / first["name"] / "hf")
            key_eval = {k: v for k, v in cfg["eval"].items() if k not in REPORT_ONLY_EVAL}
            key_src = json.dumps({"train": train, "first": first, "eval": key_eval, "vlm": p["text"],
                                  "lm": p["lm_path"].read_text()}, sort_keys=True, default=str)
            key_src = key_src.replace(str(REPO_ROOT), "<repo>")  # the same runs in another checkout are reused
            jobs.append({"arm": arm["id"], "arm_name": arm["name"], "seed": int(seed), "train": train, "first": first,
                         "eval": cfg["eval"], "threads": cfg["threads"], "run_dir": str(out / "runs" / name),
                         "key": hashlib.sha1(key_src.encode()).hexdigest()[:16]})
    return jobs


def first_stage(cfg: dict, train: dict) -> dict | None:
    """The training YAML of an arm's first stage (``first_stage`` over the arm's own; no evaluation, an export
    for the second stage), or None."""
    if not cfg.get("first_stage"):
        return None
    first = deep_merge(train, cfg["first_stage"])
    first["name"] = f"{train['name']}-first"
    first["eval"] = {**(first.get("eval") or {}), "vqa_json": None}
    first["checkpoint"] = {**(first.get("checkpoint") or {}), "export_hf": True}
    return first


class _FingerprintLoader:
    """Wraps the trainer's loader: hashes the token ids of every batch it yields (same data order
    across arms <=> same fingerprint) and delegates everything else. ``text_digest`` hashes each step's
    samples (split by ``segment_ids``) without ``skip_ids`` (image placeholders, padding), sorted within
    the step: the same samples in the same steps whatever the image tokens per image, which the VLM
    study's arms differ in and which changes how first-fit packing lays the samples into rows."""

    def __init__(self, loader, skip_ids=()):
        self._loader, self._hash, self._text, self.batches = loader, hashlib.sha1(), hashlib.sha1(), 0
        self._skip = set(skip_ids)

    def __iter__(self):
        for batch in self._loader:
            ids = batch.get("input_ids")
            if ids is not None:
                self._hash.update(ids.cpu().numpy().tobytes())
                self._text.update(b"|step|" + b"|".join(sorted(self._samples(batch))))
            self.batches += 1
            yield batch

    def _samples(self, batch) -> list[bytes]:
        """The text ids of each sample of a host batch (rows split at segment_ids changes)."""
        ids = batch["input_ids"].cpu().tolist()  # the loader's host batch: no device read
        segs = batch["segment_ids"].cpu().tolist() if batch.get("segment_ids") is not None else None
        out = []
        for r, row in enumerate(ids):
            current, prev = [], None
            for c, tok in enumerate(row):
                seg = segs[r][c] if segs is not None else 1
                if seg != prev and current:
                    out.append(current)
                    current = []
                prev = seg
                if tok not in self._skip and seg != 0:
                    current.append(tok)
            if current:
                out.append(current)
        return [bytes(str(s), "ascii") for s in out]

    @property
    def text_digest(self) -> str:
        return self._text.hexdigest()[:16]

    def __getattr__(self, name):
        return getattr(self._loader, name)

    @property
    def digest(self) -> str:
        return self._hash.hexdigest()[:16]


def _fingerprint(trainer) -> _FingerprintLoader:
    """Wrap the trainer's loader in a fingerprint that skips image placeholders and padding."""
    chat = trainer.processor.chat_tokenizer
    trainer.loader = _FingerprintLoader(trainer.loader, [i for i in (chat.image_id, chat.pad_id) if i is not None])
    return trainer.loader


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
    from vlm.config.train import load_train_config
    from vlm.training.trainer import Trainer

    t0 = time.time()
    first = _train_first_stage(job) if job.get("first") else None
    tcfg = load_train_config(raw=copy.deepcopy(job["train"]))
    trainer = Trainer(tcfg)
    fp = _fingerprint(trainer)
    try:
        trainer.fit()
        fingerprint = f"{fp.digest}/{fp.batches}"
        text_fingerprint = f"{fp.text_digest}/{fp.batches}"
        if first is not None:  # same samples in both stages <=> same joint fingerprint
            text_fingerprint = f"{first['text_fingerprint']}+{text_fingerprint}"
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
        text = evaluate_text(str(hf), str(repo_path(e["text"])), seq_len, int(e["text_batch_size"]),
                             int(e["text_max_tokens"]), tcfg.model.tokenizer and str(repo_path(tcfg.model.tokenizer)),
                             e["dtype"], device)
    if not e.get("keep_hf", True) and hf.is_dir():
        import shutil

        shutil.rmtree(hf, ignore_errors=True)
    result = {"arm": job["arm"], "arm_name": job["arm_name"], "seed": job["seed"], "key": job["key"],
              "run_dir": job["run_dir"], "params_measured": counts, "last_train_record": rec,
              "tokens_seen": int(rec.get("tokens_seen", 0)), "steps": int(rec.get("step", 0)),
              "data_fingerprint": fingerprint, "text_fingerprint": text_fingerprint,
              "vqa": {k: ev[k] for k in ("accuracy", "correct", "total", "by_kind", "ratio", "ratio_image",
                                         "ratio_text", "eval_time_s") if k in ev} or None,
              "text": text, "first_stage": first, "wall_s": round(time.time() - t0, 2)}
    summary = run_dir / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        result["train_time_s"] = s.get("train_time_s")
    (run_dir / "compare_result.json").write_text(json.dumps(result, indent=1))
    return result


def _train_first_stage(job: dict) -> dict:
    """Train the job's first stage (its export is the second stage's ``model.init_from``); its steps, tokens,
    train time and text fingerprint."""
    from vlm.config.train import load_train_config
    from vlm.training.trainer import Trainer

    trainer = Trainer(load_train_config(raw=copy.deepcopy(job["first"])))
    fp = _fingerprint(trainer)
    try:
        trainer.fit()
        trainer.finish()
        rec = dict(trainer.last_record)
    finally:
        trainer.close()
    summary = Path(job["first"]["output_dir"]) / job["first"]["name"] / "summary.json"
    return {"steps": int(rec.get("step", 0)), "tokens_seen": int(rec.get("tokens_seen", 0)),
            "train_time_s": json.loads(summary.read_text()).get("train_time_s") if summary.is_file() else None,
            "text_fingerprint": f"{fp.text_digest}/{fp.batches}"}


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
                  f"log {rel(run_dir / 'compare_log.txt')})", flush=True)
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
