"""Typed state the trainer hands to its helpers (``callbacks/``): what is fixed
for a run (``RunContext``) and the counters that advance with training and go into every
checkpoint (``Progress``)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlm.config.train import TrainConfig


@dataclass
class Progress:
    """Training counters; ``step`` counts optimizer steps taken or skipped."""

    step: int = 0
    skipped_steps: int = 0       # steps DeepSpeed skipped (non-finite gradients)
    nonfinite_in_row: int = 0    # of them, the ones in a row up to ``step``
    tokens_seen: int = 0
    train_time_s: float = 0.0    # time inside the training loop (no start-up, export, eval)
    last_record: dict = field(default_factory=dict)  # the newest metrics.jsonl record

    COUNTERS = ("skipped_steps", "nonfinite_in_row", "tokens_seen", "train_time_s")

    def counters(self) -> dict:
        """The counters a checkpoint stores besides ``step`` (which ``checkpoint.save`` writes)."""
        return {k: getattr(self, k) for k in self.COUNTERS}

    @classmethod
    def from_checkpoint(cls, trainer_state: dict) -> Progress:
        """Back from a checkpoint's ``trainer_state.json`` (missing counters start at 0)."""
        return cls(step=int(trainer_state["step"]), skipped_steps=int(trainer_state.get("skipped_steps", 0)),
                   nonfinite_in_row=int(trainer_state.get("nonfinite_in_row", 0)),
                   tokens_seen=int(trainer_state.get("tokens_seen", 0)),
                   train_time_s=float(trainer_state.get("train_time_s", 0.0)))

    def last_metrics(self) -> dict:
        """``last_record`` without the bulky per-expert loads (for summaries / checkpoints)."""
        return {k: v for k, v in self.last_record.items() if k != "expert_load"}


@dataclass(frozen=True)
class RunContext:
    """Fixed for a run. ``module`` is the engine's module: the live weights on ZeRO-1/2, a
    parameter shard on ZeRO-3 (helpers that need full weights gather them or skip)."""

    cfg: TrainConfig
    run_dir: Path
    is_main: bool                 # rank 0
    zero_stage: int
    device: str                   # "cpu" | "cuda"
    model_device: torch.device
    module: torch.nn.Module
    model_config: Any             # ConceptMoEVLMConfig or ConceptMoEConfig
    processor: Any | None         # ConceptMoEVLMProcessor (VLM) or None
    tokenizer: Any | None
    log_line: Callable[[str], None]  # a line for the console / log (rank 0 only; others ignore it)
