"""Atomic training checkpoints (DeepSpeed engine state + our JSON: step, counters, data-loader and
RNG states), the ``latest`` pointer, and resume (exact at the same world size; at another one through
DeepSpeed's universal checkpoint, ``reshard.py``). The layout and the save protocol are in ``save``'s
docstring; the discovery of the newest complete one (no torch) is ``checkpoint_paths.py``."""
from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from vlm.modeling.safe_loading import read_json
from vlm.training.checkpoint_paths import (LATEST, STEP_RE, TRAINER_STATE, _step_of, find_checkpoint,  # noqa: F401
                                          is_complete, list_checkpoints, rank_file, resolve_resume, step_dir_name)

FORMAT_VERSION = 1


class SaveHook:
    """Called by ``save`` at its named points (``ckpt.after_engine``, ``ckpt.rank_state``, ...: the
    points are listed in ``vlm.reliability.faults``, which injects faults there); this one does nothing."""

    def at(self, point: str, step: int, rank: int, path: str | os.PathLike | None = None) -> None:
        """Point ``point`` of the save of ``step`` on ``rank``; ``path``: the file a write point writes."""

    @contextlib.contextmanager
    def engine_writer(self, engine, step: int, rank: int) -> Iterator[None]:
        """Around ``engine.save_checkpoint`` (DeepSpeed's own writer)."""
        yield


NO_HOOK = SaveHook()


# --- fsync helpers ------------------------------------------------------------------------------
def fsync_file(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


def write_json(path: str | Path, obj) -> None:
    """Write JSON and fsync it (the caller decides about atomic renames)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


# --- RNG states as JSON -------------------------------------------------------------------------
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict:
    version, state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out = {"python": [version, list(state), gauss],
           "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
           "torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: dict) -> None:
    version, st, gauss = state["python"]
    random.setstate((version, tuple(st), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


# --- save / load --------------------------------------------------------------------------------
class ResumeError(RuntimeError):
    """A checkpoint that cannot be resumed here (DeepSpeed found nothing, a refused world-size change)."""


def check_expert_layout(path, model) -> None:
    """Refuse a checkpoint of a model with local MoE experts written before their gate and up became one
    parameter (no ``expert_layout``): DeepSpeed's flat optimizer partitions hold the old parameter
    order at the same total size, so master weights and moments would land wrong without an error."""
    from vlm.modeling.moe import EXPERT_LAYOUT, MoEFeedForward

    if path is None or not any(isinstance(m, MoEFeedForward) for m in model.modules()):
        return
    saved = read_json(Path(path) / TRAINER_STATE).get("expert_layout")
    if saved != EXPERT_LAYOUT:
        raise ResumeError(f"checkpoint {path} was written before the experts' gate and up were one parameter "
                          f"({EXPERT_LAYOUT}): its optimizer state does not map onto this model; resume it with the "
                          "version that wrote it, or start a new run from its HF export (model.init_from loads "
                          "the old layout)")


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the previous one is intact."""


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _first_error(err: OSError | None, rank: int) -> str | None:
    """Collective (also a barrier): ``"rank r: <error>"`` for the lowest rank whose write failed,
    the same string on every rank; None if every rank succeeded."""
    mine = None if err is None else f"rank {rank}: {err}"
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return mine
    everyone: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    return next((e for e in everyone if e is not None), None)


def _write_error(ckpt_dir: Path, name: str, cause: str) -> CheckpointWriteError:
    prev = find_checkpoint(ckpt_dir)
    if prev is not None and prev.name == name:  # renamed and complete; only `latest` failed
        return CheckpointWriteError(
            f"checkpoint {name} was written but the '{LATEST}' pointer could not be updated ({cause}); "
            "--resume auto finds it by scanning. Free space or fix the disk, then resume with --resume auto")
    return CheckpointWriteError(
        f"checkpoint {name} was not written ({cause}); the newest complete checkpoint is "
        f"{prev if prev else 'none'} (intact). Free space or fix the disk, then resume with --resume auto")


def save(engine, ckpt_dir: str | Path, step: int, trainer_state: dict, rank_state: dict,
         keep_last: int = 2, rank: int = 0, world_size: int = 1, hook: SaveHook = NO_HOOK) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint folder; raises
    ``CheckpointWriteError`` on every rank if any rank's write failed.

    Layout of ``<ckpt_dir>`` (default ``runs/<name>/ckpt``)::

        step_000123/                 one complete checkpoint
            mp_rank_00_model_states.pt, *optim_states.pt ...   engine.save_checkpoint (model,
                                     optimizer, LR scheduler; DeepSpeed's own format)
            rank_00000.json ...      per rank: RNG states (python, numpy, torch, cuda) + loader state
            trainer_state.json       rank 0, written last: step, counters, world size, config
        latest                       one line: the name of the newest complete checkpoint

    Our own files are JSON (no pickle); the torch RNG state is base64 of its bytes.

    Protocol:
     1. rank 0 removes a stale ``step_000123.tmp/`` left by an earlier crash; barrier;
     2. ``engine.save_checkpoint(ckpt_dir, tag="step_000123.tmp", save_latest=False)``;
     3. each rank writes ``rank_<r>.json`` into the tmp folder and fsyncs it; barrier;
     4. rank 0 writes ``trainer_state.json``, fsyncs every file and the folder, renames
        ``step_000123.tmp`` -> ``step_000123`` (atomic on one filesystem), fsyncs ``ckpt_dir``, then
        replaces ``latest`` atomically (write ``latest.tmp``, fsync, ``os.replace``, fsync the folder);
     5. rank 0 deletes all but the newest ``keep_last`` complete checkpoints (never the new one).
    A process killed at any point leaves either the previous checkpoint + ``latest`` untouched (kill
    before the rename) or the new one complete (kill after it; ``latest`` may still name the
    previous one, also complete). ``find_checkpoint`` never returns a ``.tmp`` folder or one without
    ``trainer_state.json`` and all of its ``rank_*.json`` files. The checkpoint folder must be on a
    filesystem all ranks share (as DeepSpeed itself assumes by default).

    A write that fails (``OSError``: ENOSPC or any other) on any rank makes every rank raise
    ``CheckpointWriteError``: the ranks agree through one all-gather, the half-written ``.tmp`` folder
    is removed, ``latest`` is never pointed at it, and the previous checkpoint stays the newest.

    ``hook`` is called at the ``ckpt.*`` points (``SaveHook``)."""
    ckpt_dir = Path(ckpt_dir)
    name = step_dir_name(step)
    final, tmp = ckpt_dir / name, ckpt_dir / f"{name}.tmp"
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    _barrier()
    err: OSError | None = None
    try:
        with hook.engine_writer(engine, step, rank):
            engine.save_checkpoint(str(ckpt_dir), tag=tmp.name, client_state={}, save_latest=False)
    except OSError as e:
        # DeepSpeed writes between its tag-validation collective and a closing barrier, which this
        # rank skipped by raising: take that barrier so the ranks stay in step, then agree below.
        err = e
        _barrier()
    if err is None:
        hook.at("ckpt.after_engine", step, rank)
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            hook.at("ckpt.rank_state", step, rank, tmp / rank_file(rank))
            write_json(tmp / rank_file(rank), {"rank": rank, "step": step, **rank_state})
        except OSError as e:
            err = e
    cause = _first_error(err, rank)
    if cause is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        raise _write_error(ckpt_dir, name, cause)
    if rank == 0:
        try:
            state = {"format_version": FORMAT_VERSION, "step": step, "world_size": world_size, **trainer_state}
            _commit(ckpt_dir, name, step, tmp, final, state, keep_last, hook)
        except OSError as e:
            err = e
    cause = _first_error(err, rank)
    if cause is not None:
        raise _write_error(ckpt_dir, name, cause)
    return final


def _commit(ckpt_dir: Path, name: str, step: int, tmp: Path, final: Path, state: dict, keep_last: int,
            hook: SaveHook) -> None:
    """Rank 0: trainer_state.json, fsync, rename, ``latest``, prune. On an OSError before the rename
    the tmp folder is removed; after it, the new checkpoint is complete (``find_checkpoint`` takes it
    even if ``latest`` could not be updated)."""
    try:
        hook.at("ckpt.before_state", step, 0)
        hook.at("ckpt.trainer_state", step, 0, tmp / TRAINER_STATE)
        write_json(tmp / TRAINER_STATE, state)
        fsync_tree(tmp)
        hook.at("ckpt.before_rename", step, 0)
        if final.exists():  # re-saving the same step (e.g. resumed at the final step): replace it
            old = ckpt_dir / f"{name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(ckpt_dir)
    hook.at("ckpt.before_latest", step, 0)
    try:
        hook.at("ckpt.latest", step, 0, ckpt_dir / (LATEST + ".tmp"))
        atomic_write_text(ckpt_dir / LATEST, name + "\n")
    except OSError:
        (ckpt_dir / (LATEST + ".tmp")).unlink(missing_ok=True)
        raise
    prune(ckpt_dir, keep_last, protect=final)
    hook.at("ckpt.after_save", step, 0)


def prune(ckpt_dir: Path, keep_last: int, protect: Path | None = None) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep_last`` and stale ``.tmp`` folders."""
    removed = []
    complete = list_checkpoints(ckpt_dir)
    for path in complete[:-keep_last] if keep_last > 0 else []:
        if protect is not None and path.resolve() == protect.resolve():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    for path in ckpt_dir.iterdir():
        if path.is_dir() and (path.name.endswith(".tmp") or path.name.endswith(".old")) and path != protect:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def load(engine, path: str | Path, rank: int, world_size: int) -> tuple[dict, dict]:
    """Collective: load the engine state; returns (trainer_state, this rank's state). Same world size
    only: DeepSpeed's own partitions and this rank's ``rank_<r>.json``, exactly (another world size:
    ``reshard.load``, after ``reshard.prepare`` converted the checkpoint)."""
    path = Path(path)
    trainer_state = read_json(path / TRAINER_STATE)
    saved_world = int(trainer_state.get("world_size", 1))
    if saved_world != world_size:
        raise ResumeError(f"checkpoint {path} was written by {saved_world} ranks, this run has {world_size}: "
                          "exact resume needs the same world size; another one loads its universal conversion "
                          "(vlm.training.reshard.prepare, done by the trainer)")
    load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if load_path is None:
        raise ResumeError(f"DeepSpeed could not load the checkpoint in {path}")
    rank_state = read_json(path / rank_file(rank))
    return trainer_state, rank_state
