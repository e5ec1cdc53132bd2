"""Fault injection for the reliability suite (``make faults``) and tests. One ``Faults`` plan is built
at start-up from ``VLM_TRAIN_FAULT`` (spec in ``parse``) by ``python -m vlm.reliability.train``, which
hands it to the trainer through two seams: the checkpoint writer's hook (``checkpoint.SaveHook``: e.g.
``faults.at("ckpt.before_rename", step, rank)``) and a callback (``InjectFaults``: the NaN loss)."""
from __future__ import annotations

import contextlib
import errno
import os
import signal
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from vlm.train import FAULT_ENV
from vlm.training.callbacks.base import Callback
from vlm.training.checkpoint import SaveHook

ENV = FAULT_ENV
# (action, name in the spec) -> fault point in the code
SPEC_POINTS = {
    **{("kill", p): f"ckpt.{p}" for p in ("after_engine", "before_state", "before_rename", "before_latest",
                                          "after_save")},
    **{("enospc", p): f"ckpt.{p}" for p in ("engine", "rank_state", "trainer_state", "latest")},
    ("nan", "loss"): "train.loss",
}
POINTS = {point: action for (action, _), point in SPEC_POINTS.items()}  # fault point -> its action
ALIASES = {"kill_during_save": ("kill", "before_state"), "kill_after_save": ("kill", "after_save")}


class FaultSpecError(ValueError):
    """A malformed ``VLM_TRAIN_FAULT`` (one line)."""


@dataclass(frozen=True)
class Fault:
    point: str              # a key of POINTS
    step: int
    rank: int | None = 0    # None: every rank


def disk_full(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def parse(spec: str | None) -> list[Fault]:
    """``VLM_TRAIN_FAULT`` -> faults; a malformed entry raises ``FaultSpecError``.

    The spec: comma-separated ``<action>:<where>:<step>[:<rank>]`` (rank 0 if omitted)::

        kill:after_engine:S     ckpt.after_engine    SIGKILL once DeepSpeed's engine files are written
        kill:before_state:S     ckpt.before_state    ... rank files written, trainer_state.json not
        kill:before_rename:S    ckpt.before_rename   ... trainer_state.json fsynced, step_S.tmp not renamed
        kill:before_latest:S    ckpt.before_latest   ... renamed, ``latest`` not yet replaced
        kill:after_save:S       ckpt.after_save      ... the save completed
        enospc:engine:S         ckpt.engine          DeepSpeed's writer writes part of a file, then ENOSPC
        enospc:rank_state:S     ckpt.rank_state      our per-rank JSON writer hits ENOSPC
        enospc:trainer_state:S  ckpt.trainer_state   the trainer_state.json writer hits ENOSPC
        enospc:latest:S         ckpt.latest          writing the new ``latest`` pointer hits ENOSPC
        nan:loss:S              train.loss           the loss of every micro-batch of step S is NaN

    ``kill_during_save:S`` (= ``kill:before_state:S``) and ``kill_after_save:S`` are accepted too.
    ENOSPC is the ``OSError(errno.ENOSPC)`` a full disk gives, raised from the writer itself, so the
    code under test takes its real error path."""
    out = []
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        parts = item.split(":")
        if parts[0] in ALIASES and len(parts) == 2:
            parts = [*ALIASES[parts[0]], parts[1]]
        point = SPEC_POINTS.get(tuple(parts[:2]))
        if point is None or len(parts) not in (3, 4) or not all(p.isdigit() for p in parts[2:]):
            choices = " | ".join(f"{a}:{w}" for a, w in SPEC_POINTS)
            raise FaultSpecError(f"{ENV}: bad fault {item!r}; expected <{choices}>:<step>[:<rank>]")
        out.append(Fault(point, int(parts[2]), int(parts[3]) if len(parts) == 4 else 0))
    return out


class Faults(SaveHook):
    """The faults of one process. Every method is a no-op unless a fault names that point, step and
    rank; ``Faults()`` (also ``bool(faults) is False``) injects nothing."""

    def __init__(self, faults: Iterable[Fault] = ()):
        self.faults = frozenset(faults)
        unknown = sorted({f.point for f in self.faults} - set(POINTS))
        if unknown:
            raise FaultSpecError(f"unknown fault point(s) {unknown}; known: {sorted(POINTS)}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Faults:
        """The plan in ``VLM_TRAIN_FAULT`` of ``environ`` (default ``os.environ``)."""
        env = os.environ if environ is None else environ
        return cls(parse(env.get(ENV)))

    def __bool__(self) -> bool:
        return bool(self.faults)

    def __repr__(self) -> str:
        return f"Faults({sorted(self.faults, key=lambda f: (f.step, f.point))})"

    def active(self, point: str, step: int, rank: int) -> bool:
        if point not in POINTS:
            raise KeyError(f"no fault point {point!r}; known: {sorted(POINTS)}")
        return Fault(point, step, rank) in self.faults or Fault(point, step, None) in self.faults

    def at(self, point: str, step: int, rank: int, path: str | os.PathLike | None = None) -> None:
        """A kill point (SIGKILL this process) or a write point (raise ENOSPC for ``path``)."""
        if not self.active(point, step, rank):
            return
        if POINTS[point] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif POINTS[point] == "enospc":
            raise disk_full(path)
        else:
            raise ValueError(f"fault point {point!r} is not a kill or write point")

    def loss(self, loss, step: int, rank: int):
        """``train.loss``: ``loss`` turned into NaN at a faulty step (a tensor op, so the NaN flows
        through backward like a real one); ``loss`` itself otherwise."""
        return loss * float("nan") if self.active("train.loss", step, rank) else loss

    @contextlib.contextmanager
    def engine_writer(self, engine, step: int, rank: int) -> Iterator[None]:
        """``ckpt.engine``: DeepSpeed's checkpoint writer (``engine.checkpoint_engine.save``) writes a
        few bytes of its first file and then fails with ENOSPC (a disk filling up mid-file)."""
        ce = getattr(engine, "checkpoint_engine", None)
        if ce is None or not self.active("ckpt.engine", step, rank):
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


NO_FAULTS = Faults()


class InjectFaults(Callback):
    """The plan ``faults`` in a training run: its ``ckpt.*`` points on the trainer's checkpoint writer
    (``Trainer.save_hook``), ``train.loss`` on the loss of every micro-batch of its step."""

    def __init__(self, faults: Faults):
        self.faults = faults

    def on_fit_start(self, trainer) -> None:
        trainer.save_hook = self.faults

    def on_micro_batch(self, trainer, out, batch: dict) -> None:
        out.loss = self.faults.loss(out.loss, trainer.step + 1, trainer.rank)
