"""Fault injection hooks for the reliability suite (``make faults``, tests). Never set in real runs.

``VLM_TRAIN_FAULT`` holds comma-separated faults ``<action>:<point>:<step>[:<rank>]`` (rank 0 if
omitted). ``checkpoint.save`` calls the hooks at these points of the save of ``<step>``:

    kill:after_engine:S     SIGKILL once DeepSpeed's engine files are written (our metadata not yet)
    kill:before_state:S     ... once every rank file is written, before trainer_state.json
    kill:before_rename:S    ... once trainer_state.json is fsynced, before step_S.tmp -> step_S
    kill:before_latest:S    ... after the rename, before the ``latest`` pointer is replaced
    kill:after_save:S       ... right after the save completed
    enospc:engine:S         DeepSpeed's checkpoint writer writes part of a file, then the disk is full
    enospc:rank_state:S     our per-rank JSON writer hits ENOSPC
    enospc:trainer_state:S  the trainer_state.json writer hits ENOSPC
    enospc:latest:S         writing the new ``latest`` pointer hits ENOSPC

The old spellings ``kill_during_save:S`` (= ``kill:before_state:S``) and ``kill_after_save:S`` are
accepted. ENOSPC is raised as the ``OSError(errno.ENOSPC)`` a full disk gives, from the writer
itself, so the code under test is the real error path.
"""
from __future__ import annotations

import contextlib
import errno
import os
import signal
from dataclasses import dataclass

ENV = "VLM_TRAIN_FAULT"
KILL_POINTS = ("after_engine", "before_state", "before_rename", "before_latest", "after_save")
ENOSPC_POINTS = ("engine", "rank_state", "trainer_state", "latest")
ALIASES = {"kill_during_save": ("kill", "before_state"), "kill_after_save": ("kill", "after_save")}


@dataclass(frozen=True)
class Fault:
    action: str
    point: str
    step: int
    rank: int = 0


def parse(spec: str | None) -> list[Fault]:
    """``VLM_TRAIN_FAULT`` -> faults; a malformed entry is a one-line ValueError."""
    out = []
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        parts = item.split(":")
        if parts[0] in ALIASES and len(parts) == 2:
            parts = [*ALIASES[parts[0]], parts[1]]
        points = {"kill": KILL_POINTS, "enospc": ENOSPC_POINTS}.get(parts[0])
        if points is None or len(parts) not in (3, 4) or parts[1] not in points or not all(
                p.isdigit() for p in parts[2:]):
            raise ValueError(f"{ENV}: bad fault {item!r}; expected kill:<{'|'.join(KILL_POINTS)}>:<step>[:<rank>] "
                             f"or enospc:<{'|'.join(ENOSPC_POINTS)}>:<step>[:<rank>]")
        out.append(Fault(parts[0], parts[1], int(parts[2]), int(parts[3]) if len(parts) == 4 else 0))
    return out


def _active(action: str, point: str, step: int, rank: int) -> bool:
    return Fault(action, point, step, rank) in parse(os.environ.get(ENV))


def kill_point(point: str, step: int, rank: int) -> None:
    if _active("kill", point, step, rank):
        os.kill(os.getpid(), signal.SIGKILL)


def disk_full(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def enospc_point(point: str, step: int, rank: int, path) -> None:
    if _active("enospc", point, step, rank):
        raise disk_full(path)


@contextlib.contextmanager
def engine_writer(engine, step: int, rank: int):
    """With ``enospc:engine:<step>`` for this rank: DeepSpeed's checkpoint writer writes a few
    bytes of its first file and then fails with ENOSPC (a disk filling up mid-file)."""
    ce = getattr(engine, "checkpoint_engine", None)
    if ce is None or not _active("enospc", "engine", step, rank):
        yield
        return
    real = ce.save

    def full_disk_save(state_dict, path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04 partial")
        raise disk_full(path)

    ce.save = full_disk_save
    try:
        yield
    finally:
        ce.save = real
