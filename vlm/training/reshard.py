"""Resume at another world size through DeepSpeed's universal checkpoint.

A checkpoint (``checkpoint.save``) holds ZeRO partitions cut for the world size that wrote it, and
one ``rank_<r>.json`` (RNG + data-loader state) per rank of that run. To continue on W' != W ranks:

1. Engine state. Rank 0 converts the checkpoint once with DeepSpeed's converter
   (``deepspeed.checkpoint.ds_to_universal``): per-parameter fp32 weights and Adam moments, no
   partitions, into ``<step>/universal/`` (written as ``universal.tmp/``, then renamed: a folder named
   ``universal`` is always complete and is reused by later resumes). The engine is built with
   ``"checkpoint": {"load_universal": true}`` and re-partitions it for W' ranks while loading;
   the LR schedule, step counters and optimizer hyper-parameters come from the same files.
   ZeRO-1/2/3 convert; ZeRO stage 0 (no ZeRO optimizer) and expert parallelism (sharded experts,
   ``parallel.expert_parallel_size`` > 1 then or now: not covered by this path) are refused with one line.
2. Data position. Every rank's loader state is the same global count (``samples_consumed`` for
   the mixture loader, whose rank r of W reads global positions ``local * W + r``): positions
   ``[0, samples_consumed)`` were read. New rank r' resumes at local ``samples_consumed // W'``, so
   the positions ``[W' * (samples_consumed // W'), samples_consumed)`` are read a second time:
   fewer than W' of them (``samples_consumed % W'``), none when W' divides it, and none are
   skipped. The per-rank counters (``seen``, ``bad_counts``) are summed into new rank 0 and start
   at 0 on the others, so the run's totals are kept. The synthetic loader (a pure function of
   seed, rank and batch index) keeps its batch index: its streams are per rank, so a new rank
   starts a stream no rank read before.
3. RNG. New rank r < W takes old rank r's state. A rank that did not exist (r >= W) gets a
   derived state: python / numpy / torch (and CUDA) seeded with
   ``seed * 1000 + 1 + r + 1_000_003 * step`` (the fresh-run per-rank seed ``seed * 1000 + 1 + r``
   moved on by the step), a pure function of (seed, rank, step).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from vlm.modeling.safe_loading import read_json
from vlm.training.checkpoint import TRAINER_STATE, ResumeError, rank_file, rng_state, set_rng_state

UNIVERSAL = "universal"
COUNTERS = ("seen", "bad_counts")  # per-rank loader counters; everything else is global


class ReshardError(ResumeError):
    """A checkpoint that cannot be resumed at this world size (one line)."""


def universal_dir(path: str | Path) -> Path:
    return Path(path) / UNIVERSAL


def prepare(path: Path | None, world_size: int, zero_stage: int, ds_config: dict, rank: int, log_line,
            expert_parallel: int = 1) -> Path | None:
    """Collective, before ``deepspeed.initialize``. For a checkpoint written by another world size:
    convert it once (rank 0; the others wait), set ``ds_config["checkpoint"]["load_universal"]``
    and return the universal folder. None (nothing changed) for no checkpoint or the same world size."""
    if path is None:
        return None
    state = read_json(Path(path) / TRAINER_STATE)
    saved = int(state.get("world_size", 1))
    if saved == world_size:
        return None
    saved_stage = int(state.get("zero_stage", zero_stage))
    if saved_stage == 0 or zero_stage == 0:
        raise ReshardError(f"checkpoint {path} ({saved} ranks) cannot resume on {world_size} ranks under ZeRO stage 0 "
                           "(DeepSpeed's universal checkpoint needs a ZeRO optimizer): train and resume with zero1/2/3")
    saved_ep = int(((state.get("config") or {}).get("parallel") or {}).get("expert_parallel_size", 1))
    if max(saved_ep, expert_parallel) > 1:
        raise ReshardError(f"checkpoint {path} ({saved} ranks, expert_parallel_size {saved_ep}) cannot resume on "
                           f"{world_size} ranks with expert_parallel_size {expert_parallel}: resuming at another "
                           f"world size covers data parallelism only (experts not sharded); resume on {saved} ranks")
    out = universal_dir(path)
    err = None
    if rank == 0 and not out.is_dir():
        try:
            convert(path, out)
            log_line(f"[train] checkpoint {path} was written by {saved} ranks, this run has {world_size}: converted it "
                     f"once to DeepSpeed's universal checkpoint {out}")
        except ReshardError as e:
            err = str(e)
    elif rank == 0:
        log_line(f"[train] checkpoint {path} was written by {saved} ranks, this run has {world_size}: loading its "
                 f"universal checkpoint {out}")
    err = _agree(err)
    if err is not None:
        raise ReshardError(err)
    ds_config.setdefault("checkpoint", {})["load_universal"] = True
    return out


def _agree(err: str | None) -> str | None:
    """Collective (also a barrier): rank 0's error on every rank."""
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return err
    box = [err]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def convert(path: Path, out: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` on one checkpoint folder, into ``out`` (atomic rename). Its
    progress output goes to ``out/convert.log``; any failure raises a one-line ``ReshardError``
    and leaves neither ``out`` nor ``out.tmp`` behind."""
    from deepspeed.checkpoint import ds_to_universal

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    args = argparse.Namespace(input_folder=str(path), output_folder=str(tmp), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            ds_to_universal.main(args)
    except Exception as e:  # the converter raises asserts, ValueErrors, NotImplementedErrors ...
        shutil.rmtree(tmp, ignore_errors=True)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ReshardError(f"DeepSpeed's universal checkpoint converter cannot convert {path}: {first}") from None
    try:
        (path / "latest_universal").unlink(missing_ok=True)  # the converter's pointer; we pass the tag
        (tmp / "convert.log").write_text(log.getvalue(), encoding="utf-8")
        os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ReshardError(f"could not write the universal checkpoint {out}: {e}") from None


def load_engine(engine, universal: Path) -> None:
    """Load the converted engine state (the engine was built with ``load_universal``)."""
    load_path, _ = engine.load_checkpoint(str(universal.parent), tag=universal.name, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if load_path is None:
        raise ResumeError(f"DeepSpeed could not load the universal checkpoint in {universal}")
    if engine.zero_optimization_stage() == 3:
        _repair_zero3_groups(engine.optimizer.optimizer, universal)


def _repair_zero3_groups(base, universal: Path) -> None:
    """Undo two slips of DeepSpeed 0.19.8's ZeRO-3 universal load
    (``load_hp_checkpoint_state_from_checkpoint_dir_stage3``), which ZeRO-1/2 do not make:

    - every sub-group's optimizer state gets the SAME ``step`` tensor object; torch's AdamW
      increments it in place once per sub-group, so Adam's bias correction runs ahead (measured:
      the second step after a resume off by 2e-2 in the loss). Each state gets its own copy.
    - every param group gets group 0's hyper-parameters (weight decay, name, per-part LR ...). Ours
      differ per group (decay / no_decay, ``optim.py``): each group gets its own saved ones back
      (the parameters, which ZeRO-3 keeps out of the groups, stay as DeepSpeed set them)."""
    for state in base.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    saved = torch.load(universal / "zero" / "optimizer_state.pt", map_location="cpu", weights_only=False)
    groups = saved["optimizer_state_dict"]["param_groups"]
    if len(groups) != len(base.param_groups):
        raise ResumeError(f"universal checkpoint {universal}: {len(groups)} optimizer param groups saved, "
                          f"this run has {len(base.param_groups)}")
    for group, old in zip(base.param_groups, groups):
        group.update({k: v for k, v in old.items() if k != "params"})


def load(engine, path: Path, universal: Path, rank: int, seed: int) -> tuple[dict, dict]:
    """Collective: the engine state from the ``universal`` conversion of checkpoint ``path`` (the
    engine was built with ``load_universal``); returns (trainer_state, this rank's mapped state)."""
    trainer_state = read_json(path / TRAINER_STATE)
    load_engine(engine, Path(universal))
    saved, step = int(trainer_state.get("world_size", 1)), int(trainer_state.get("step", 0))
    return trainer_state, rank_state(path, rank, saved, seed, step)


def rank_state(path: Path, rank: int, saved: int, seed: int, step: int) -> dict:
    """This rank's state at the new world size (module docstring, points 2 and 3)."""
    mine = read_json(path / rank_file(min(rank, saved - 1)))  # any old rank's data state: the count is global
    data = dict(mine["data"])
    if any(k in data for k in COUNTERS):
        if rank == 0:  # only rank 0 reads every old rank's file
            states = [read_json(path / rank_file(r)) for r in range(saved)]
            data["seen"] = sum(int(s["data"].get("seen", 0)) for s in states)
            total: dict = {}
            for s in states:
                for k, v in (s["data"].get("bad_counts") or {}).items():
                    total[k] = total.get(k, 0) + int(v)
            data["bad_counts"] = total
        else:
            data["seen"], data["bad_counts"] = 0, {}
    mine["data"] = data
    mine["rank"] = rank
    if rank >= saved:
        mine["rng"] = derived_rng_state(seed, rank, step)
    return mine


def derived_rng_state(seed: int, rank: int, step: int) -> dict:
    """The RNG state of a rank that did not exist in the saved run: every generator seeded with
    ``seed * 1000 + 1 + rank + 1_000_003 * step``. The process's own generators are left as they were."""
    before = rng_state()
    s = seed * 1000 + 1 + rank + 1_000_003 * step
    random.seed(s)
    np.random.seed(s % (2 ** 32))
    torch.manual_seed(s)
    out = rng_state()
    set_rng_state(before)
    return out
