"""Where checkpoints are on disk: the step folders, the ``latest`` pointer, which folder is complete, the
newest one, and what ``--resume`` names. Files only (no torch): ``python -m vlm.train`` checks ``--resume``
with it before torch loads; writing and loading are in ``checkpoint.py``."""
from __future__ import annotations

import re
from pathlib import Path

from vlm.modeling.safe_loading import read_json

STEP_RE = re.compile(r"^step_(\d{6,})$")
LATEST = "latest"
TRAINER_STATE = "trainer_state.json"


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def is_complete(path: str | Path) -> bool:
    """A finished checkpoint: not a .tmp folder, trainer_state.json and every rank file present."""
    path = Path(path)
    if not path.is_dir() or not STEP_RE.match(path.name):
        return False
    state_file = path / TRAINER_STATE
    if not state_file.is_file():
        return False
    try:
        state = read_json(state_file)
    except (OSError, ValueError):
        return False
    if not isinstance(state, dict):
        return False
    return all((path / rank_file(r)).is_file() for r in range(int(state.get("world_size", 1))))


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if STEP_RE.match(p.name) and is_complete(p)]
    return sorted(found, key=lambda p: int(STEP_RE.match(p.name).group(1)))


def find_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The newest complete checkpoint: the ``latest`` pointer if it is valid, else a scan."""
    ckpt_dir = Path(ckpt_dir)
    pointer = ckpt_dir / LATEST
    candidates = list_checkpoints(ckpt_dir)
    newest = candidates[-1] if candidates else None
    try:  # an unreadable pointer (binary, not UTF-8) counts as absent: fall back to the scan
        name = pointer.read_text(encoding="utf-8").strip() if pointer.is_file() else ""
    except (OSError, UnicodeDecodeError):
        name = ""
    if STEP_RE.match(name):  # a step folder name, nothing else (no paths)
        target = ckpt_dir / name
        if is_complete(target):
            # a crash between the rename and the pointer update leaves a newer complete one
            if newest is not None and _step_of(newest) > _step_of(target):
                return newest
            return target
    return newest


def resolve_resume(resume: str | None, ckpt_dir: str | Path) -> Path | None:
    """``--resume`` value -> checkpoint folder (None = start fresh).

    ``auto``: the newest complete checkpoint in this run's ckpt dir, or None if there is none.
    A path: a checkpoint folder (``.../step_000123``) or a ckpt dir (its newest checkpoint)."""
    if not resume:
        return None
    if resume == "auto":
        return find_checkpoint(ckpt_dir)
    path = Path(resume)
    if not path.exists():
        raise FileNotFoundError(f"--resume {resume}: folder does not exist")
    if STEP_RE.match(path.name):
        if not is_complete(path):
            raise FileNotFoundError(f"--resume {resume}: not a complete checkpoint (missing {TRAINER_STATE} "
                                    "or rank files, or still a .tmp folder)")
        return path
    found = find_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"--resume {resume}: no complete checkpoint in that folder")
    return found


def _step_of(path: Path) -> int:
    return int(STEP_RE.match(path.name).group(1))
