"""Training metrics: per-micro-batch accumulation, cross-rank reduction, rank-0 sinks (metrics.jsonl,
TensorBoard, W&B, the progress bar) and MFU; ``MetricsLogger`` lists the keys of a record."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from vlm.modeling.chunking import achieved_ratio, concept_counts
from vlm.training.distributed import all_reduce_sum

IGNORE_INDEX = -100
SCALARS = ("loss", "lm_loss", "ratio_loss", "lb_loss", "z_loss")
# counters summed over micro-batches and ranks (index into the reduction vector): the host's (from the batch
# as the collator built it) and the device's (from the model's outputs)
HOST_COUNTERS = ("micro", "tokens", "rows", "samples", "tok_img", "tok_txt", "prob_n", "padded_tokens",
                 "doc_tokens_sq")
DEVICE_COUNTERS = ("nonfinite", "bnd", "bnd_img", "bnd_txt", "prob_sum")
COUNTERS = HOST_COUNTERS + DEVICE_COUNTERS


def doc_tokens_sq(segment_ids_BT) -> float:
    """Sum over the documents of a batch of (document length)^2: a document is a run of one segment id
    > 0 in a row (packing; a padded row is one document). On the host (numpy), where the batch is built."""
    seg = np.asarray(segment_ids_BT, dtype=np.int64)
    B, T = seg.shape
    key_BT = np.arange(B)[:, None] * (T + 1) + seg.clip(0, T)
    counts = np.bincount(key_BT.ravel(), weights=(seg > 0).ravel().astype(np.float64), minlength=B * (T + 1))
    return float(np.square(counts).sum())


def _host(t) -> np.ndarray:
    """A batch tensor as numpy: the collator's CPU tensors (no copy); a device tensor is read (tests only)."""
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


def host_counts(batch: dict, image_token_id: int | None, chunking: bool) -> np.ndarray:
    """``HOST_COUNTERS`` of one micro-batch from its host tensors: no device op, no copy to the device."""
    valid = _host(batch["attention_mask"]) != 0
    seg = batch.get("segment_ids")
    c = dict.fromkeys(HOST_COUNTERS, 0.0)
    c["micro"], c["tokens"], c["padded_tokens"], c["rows"] = 1.0, float(valid.sum()), float(valid.size), float(len(valid))
    c["samples"] = float(batch.get("num_samples", len(valid)))
    c["doc_tokens_sq"] = doc_tokens_sq(_host(seg) if seg is not None else valid)
    if chunking:
        c["prob_n"] = c["tokens"]
        if image_token_id is not None:
            c["tok_img"] = float(((_host(batch["input_ids"]) == image_token_id) & valid).sum())
            c["tok_txt"] = c["tokens"] - c["tok_img"]
    return np.array([c[k] for k in HOST_COUNTERS], dtype=np.float64)


class WindowStats:
    """Sums over the micro-batches of one logging window on this rank.

    What the batch tells is summed on the host (``host_counts``); what the model computed (losses,
    boundaries) as one tensor on the model's device, with no host sync per micro-batch and no copy of the
    batch to the device (the trainer's moved inputs, ``batch["device"]``, are read there); ``reduce`` moves
    the totals to the host once per log step."""

    def __init__(self, image_token_id: int | None):
        self.image_token_id = image_token_id
        self.reset()

    def reset(self) -> None:
        self.host = np.zeros(len(HOST_COUNTERS))
        self.acc: torch.Tensor | None = None  # [len(SCALARS) + len(DEVICE_COUNTERS)] float64
        self.experts: torch.Tensor | None = None
        self.t0 = time.perf_counter()

    @property
    def micro(self) -> float:
        return float(self.host[HOST_COUNTERS.index("micro")])

    @torch.no_grad()
    def add(self, out, batch: dict) -> None:
        b = getattr(out, "boundary_mask", None)
        self.host += host_counts(batch, self.image_token_id, b is not None)
        loss = out.loss.detach()
        finite = torch.isfinite(loss)
        zero = torch.zeros((), dtype=torch.float32, device=loss.device)  # fp32: counts exact to 2^24 per micro-batch
        vals = [getattr(out, k, None) for k in SCALARS]
        vals = [zero if v is None else v.detach().float() for v in vals]
        c = dict.fromkeys(DEVICE_COUNTERS, zero)
        c["nonfinite"] = ~finite
        if b is not None:
            moved = batch.get("device") or {}
            valid = moved.get("attention_mask", batch["attention_mask"]).to(loss.device).bool()
            img = None
            if self.image_token_id is not None:
                img = moved.get("input_ids", batch["input_ids"]).to(loss.device) == self.image_token_id
            n = concept_counts(b, valid, img)
            c["bnd"] = n["concepts"].sum()
            if img is not None:
                c["bnd_img"], c["bnd_txt"] = n["concepts_image"].sum(), n["concepts_text"].sum()
            p = getattr(out, "boundary_probs", None)
            if p is not None:
                c["prob_sum"] = (p.detach().float() * valid).sum()
        scalars = torch.where(finite, torch.stack(vals), 0.0)  # a non-finite micro-batch adds no loss
        vec = torch.cat([scalars, torch.stack([c[k].float() for k in DEVICE_COUNTERS])]).double()
        self.acc = vec if self.acc is None else self.acc + vec
        tpe = getattr(out, "tokens_per_expert", None)
        if tpe:
            stacked = torch.stack([t.detach() for t in tpe]).double()
            self.experts = stacked if self.experts is None else self.experts + stacked

    def reduce(self) -> dict:
        """All-reduce (sum) over ranks; every rank must call it at the same step."""
        n = len(SCALARS) + len(DEVICE_COUNTERS)
        dev = self.acc.cpu() if self.acc is not None else torch.zeros(n, dtype=torch.float64)
        vec = all_reduce_sum(torch.cat([dev, torch.from_numpy(self.host)]))
        sums = dict(zip(SCALARS, vec[: len(SCALARS)].tolist()))
        cnt = dict(zip(DEVICE_COUNTERS + HOST_COUNTERS, vec[len(SCALARS):].tolist()))
        experts = None
        if self.experts is not None:
            experts = all_reduce_sum(self.experts.cpu().clone())
        return {"sums": sums, "count": cnt, "experts": experts}


def process_health() -> dict:
    """This process's resident memory (MiB) and open file descriptors, from Linux /proc ({} where
    there is no /proc): logged with every record so a leak shows up in metrics.jsonl."""
    out = {}
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            out["rss_mib"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
        out["open_fds"] = len(os.listdir("/proc/self/fd"))
    except (OSError, ValueError, IndexError):
        pass
    return out


def summarize(red: dict, elapsed: float, world_size: int) -> dict:
    s, c = red["sums"], red["count"]
    finite_micro = max(c["micro"] - c["nonfinite"], 1.0)
    out = {k: s[k] / finite_micro for k in SCALARS}
    if c["micro"] and c["nonfinite"] == c["micro"]:
        out = {k: float("nan") for k in SCALARS}
    for name, tok, bnd in (("ratio", "tokens", "bnd"), ("ratio_image", "tok_img", "bnd_img"),
                           ("ratio_text", "tok_txt", "bnd_txt")):
        if c[bnd]:
            out[name] = achieved_ratio(c[tok], c[bnd])
    if c["prob_n"]:
        out["boundary_prob"] = c["prob_sum"] / c["prob_n"]
    if red["experts"] is not None:
        e = red["experts"]
        frac = e / e.sum(-1, keepdim=True).clamp(min=1)
        out["expert_load"] = [[round(float(x), 5) for x in row] for row in frac]
        out["expert_load_max"] = float((frac.max(-1).values * frac.shape[-1]).max())
    out["tokens"] = int(c["tokens"])
    out["nonfinite_loss"] = int(c["nonfinite"])
    out["tokens_per_s"] = c["tokens"] / max(elapsed, 1e-9)
    out["samples_per_s"] = c["samples"] / max(elapsed, 1e-9)
    out["mean_row_len"] = c["padded_tokens"] / max(c["rows"], 1.0)
    # the document length a token sits in, token-weighted: what its causal attention spans (x 1/2)
    out["mean_doc_len"] = c["doc_tokens_sq"] / max(c["tokens"], 1.0)
    return out


def train_flops_per_token(text_config, seq_len: float, ratio: float | None, causal_half: bool = True,
                          trains=None) -> float | None:
    """Training FLOPs per token of the language model. ``seq_len``: the token-weighted mean document
    length (``mean_doc_len``), so with ``causal_half`` the attention map counts what causal attention
    within each document does. ``trains``: a ``vlm.flops.training.Trains`` (None: everything trains, 3 x
    forward); frozen parts count forward + input gradient, or forward only where no gradient flows."""
    try:
        from vlm.flops.training import Trains, train_flops_per_token as count
    except ImportError:
        return None
    try:
        return float(count(text_config, max(round(seq_len), 1),
                           ratio=ratio if getattr(text_config, "chunking", False) else None,
                           causal_half=causal_half, trains=trains or Trains()))
    except Exception:  # noqa: BLE001 - a FLOPs estimate must never stop training
        return None


class MfuMeter:
    """MFU = achieved model FLOP/s / (peak FLOP/s per device x devices). Above 100% the peak is wrong (below
    what ran): that window gets no MFU, and the first such window says so in one line."""

    def __init__(self, peak_per_device: float, devices: int, peak_label: str, log_line=print):
        self.peak_total = peak_per_device * devices
        self.peak_label, self.log_line, self.warned = peak_label, log_line, False

    def __call__(self, flops_per_s: float, step: int) -> dict:
        mfu = flops_per_s / self.peak_total
        if mfu <= 1.0:
            return {"mfu": mfu}
        if not self.warned:
            self.log_line(f"[train] step {step}: no MFU: the model's {flops_per_s:.3g} FLOP/s exceed the peak "
                          f"({self.peak_label}) x devices; set log.peak_flops to the device's real peak")
            self.warned = True
        return {}


class MetricsLogger:
    """Rank-0 sinks: tqdm bar (or, with the bar off, one ``progress_line`` per log step) and the
    ``log.report_to`` sinks: tensorboard, wandb, jsonl. Other ranks get a no-op instance.

    Every log step (``log.every_steps``) rank 0 writes one JSON line to ``runs/<name>/metrics.jsonl``,
    the same scalars to TensorBoard (``runs/<name>/tb``) and to W&B (``wandb.log(..., step=step)``, the
    same ``train/<key>`` / ``eval/<key>`` / ``lr/<group>`` names; the run is named after ``name`` in the
    project ``$WANDB_PROJECT`` or ``conceptmoe-vl``, its files under ``$WANDB_DIR`` or ``runs/<name>``;
    ``WANDB_MODE=offline`` needs no account), and updates the tqdm bar. Keys:

        step, time_s, loss, lm_loss, ratio_loss, lb_loss, z_loss   (means over the window's
                                                          micro-batches and ranks; ``loss`` is the
                                                          weighted total the model optimises)
        ratio, ratio_image, ratio_text   achieved R = tokens / concepts, pooled over the window
        boundary_prob                    mean router probability p over real tokens
        expert_load                      [layer run][expert] fraction of routed assignments
        expert_load_max                  max over layers of (busiest expert's fraction x E): 1 = balanced
        tokens, tokens_per_s, samples_per_s, mfu, flops_per_token (training, LM only)
        lr (first group), lr_groups {group: lr}, grad_norm
        skipped_steps (total), nonfinite_in_row, nonfinite_loss (micro-batches in the window)
        skipped_samples {reason: count}  cumulative bad-data counts of the loader, summed over ranks

    With ``eval.every_steps`` extra lines hold the periodic held-out score instead: step,
    eval_vqa_accuracy, eval_vqa_<value> (one per value of the record field ``eval.breakdown_by``; the
    default data's ``kind``: digit / parity / plus_one), eval_ratio[_image|_text], eval_time_s.

    MFU = tokens/s x training FLOPs per token / (peak FLOP/s per device x devices). FLOPs per token
    come from ``vlm.flops.training.train_flops_per_token`` at the window's mean document length and
    achieved ratio, counting what trains (3 x forward when everything does; a frozen LM under a trained
    projector: forward + input gradient); the vision tower and projector are not counted. Without
    ``vlm.flops`` MFU is left out. The peak: ``log.peak_flops``, else a GPU's spec sheet, else a measured
    CPU matmul peak (``vlm.training.peak.resolve_peak``, logged at the start). A window whose MFU would
    exceed 100% (the peak is wrong) gets no ``mfu``, with one line.
    """

    def __init__(self, run_dir: Path, enabled: bool, total_steps: int, initial_step: int, progress_bar: bool,
                 sinks=("tensorboard", "jsonl"), run_name: str | None = None, run_config: dict | None = None):
        self.enabled = enabled
        self.total_steps = total_steps
        self.bar = self.tb = self.jsonl = self.wandb = None
        if "wandb" in sinks:
            require_wandb()  # every rank: the same one-line error everywhere, not a hang
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, desc="train", dynamic_ncols=True,
                            mininterval=1.0, smoothing=0.1)
        if "tensorboard" in sinks:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tb"))
            except Exception as err:  # noqa: BLE001 - logging must not stop training
                print(f"[train] TensorBoard disabled: {err}", flush=True)
        if "wandb" in sinks:
            self.wandb = start_wandb(run_dir, run_name or run_dir.name, run_config)
        if "jsonl" in sinks:
            self.jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        step = record["step"]
        if self.bar is not None and "loss" in record:
            post = {"loss": f"{record.get('loss', float('nan')):.4f}"}
            if "ratio" in record:
                post["R"] = f"{record['ratio']:.2f}"
            post["tok/s"] = f"{record.get('tokens_per_s', 0):.0f}"
            self.bar.set_postfix(post, refresh=False)
        elif "loss" in record:  # no bar: one line per log step, so a plain log shows progress too
            print(progress_line(record, self.total_steps), flush=True)
        if self.tb is not None:
            for tag, val in scalars(record).items():
                self.tb.add_scalar(tag, val, step)
            for li, row in enumerate(record.get("expert_load") or []):
                for e, frac in enumerate(row):
                    self.tb.add_scalar(f"expert_load/run{li:02d}/e{e:02d}", frac, step)
        if self.wandb is not None:
            try:
                self.wandb.log(scalars(record), step=step)
            except Exception as err:  # noqa: BLE001 - logging must not stop training
                print(f"[train] W&B disabled: {err}", flush=True)
                self.wandb = None
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(_jsonable(record)) + "\n")
            self.jsonl.flush()

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception as err:  # noqa: BLE001
                print(f"[train] W&B finish failed: {err}", flush=True)
        if self.jsonl is not None:
            self.jsonl.close()
        self.bar = self.tb = self.jsonl = self.wandb = None


def scalars(record: dict) -> dict[str, float]:
    """The record's finite numbers as TensorBoard / W&B tags: ``train/<key>`` (``eval/<key>`` for
    ``eval_*``), ``lr/<group>``, ``skipped_samples/<reason>``."""
    out = {}
    for key, val in record.items():
        if isinstance(val, (int, float)) and not isinstance(val, bool) and math.isfinite(val) and key != "step":
            out[f"{'eval' if key.startswith('eval_') else 'train'}/{key}"] = val
    for key, val in (record.get("lr_groups") or {}).items():
        out[f"lr/{key}"] = val
    for reason, n in (record.get("skipped_samples") or {}).items():
        out[f"skipped_samples/{reason}"] = n
    return out


def require_wandb() -> None:
    """``log.report_to: [wandb]`` needs the package: one line if it is missing. ``vlm.train`` hides
    wandb from timm's optional import (``sys.modules['wandb'] = None``); asked for, it is unhidden."""
    if "wandb" in sys.modules and sys.modules["wandb"] is None:
        del sys.modules["wandb"]
    if importlib.util.find_spec("wandb") is None:
        from vlm.modeling.config_base import ConfigError

        raise ConfigError("config error: log.report_to: wandb is not installed (pip install wandb)")


def start_wandb(run_dir: Path, name: str, run_config: dict | None):
    """``wandb.init`` for this run (None, with one line, if W&B cannot start: logging never stops training)."""
    try:
        import wandb

        return wandb.init(project=os.environ.get("WANDB_PROJECT") or "conceptmoe-vl", name=name,
                          config=run_config or {}, dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
                          settings=wandb.Settings(console="off"))
    except Exception as err:  # noqa: BLE001 - logging must not stop training
        print(f"[train] W&B disabled: {err}", flush=True)
        return None


def progress_line(record: dict, total_steps: int | None = None) -> str:
    """``[train] step 10/100 loss 2.3456 R 2.01 tokens/s 1,234`` (+ skipped samples when any)."""
    step = f"{record['step']}/{total_steps}" if total_steps else f"{record['step']}"
    parts = [f"[train] step {step}", f"loss {record.get('loss', float('nan')):.4f}"]
    if record.get("ratio") is not None:
        parts.append(f"R {record['ratio']:.2f}")
    parts.append(f"tokens/s {record.get('tokens_per_s', 0):,.0f}")
    bad = sum((record.get("skipped_samples") or {}).values())
    if bad:
        parts.append(f"skipped samples {bad}")
    return " ".join(parts)


def _jsonable(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)  # NaN/inf as strings keep the file strict JSON
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj
