"""Which implementation runs the LM loss, the RMSNorms and the experts' SwiGLU (``train.fused_kernels``).

  cross_entropy  torch: ``chunked_lm_loss`` (head + fp32 CE per checkpointed chunk)
                 liger: liger-kernel's fused linear cross entropy (``liger_ops.py``: no logits kept)
  rms_norm       torch: ``rms_norm.rms_norm``       liger: liger's RMSNorm kernels (``liger_ops.py``)
  swiglu         torch: ``expert_mlp.GroupedSwiGLU``
                 triton: ours (``expert_mlp_fused.py``; liger's SwiGLU does not fit the fused gate/up layout)
Each kernel is ``auto`` (its fused implementation on CUDA where the package imports, the model fits it
and the GPU check measured it correct and faster (``gpu_verdicts.json``, verdicts.py), else the torch
path: said once in the log, with the reason), ``torch``, or its fused name
(where it cannot run: one error line). The choice is process-wide (unlike ``ConceptMoEConfig.runtime``): ``configure``
(the trainer's ``prepare_model``) sets ``ACTIVE`` / ``IMPL``, which the dispatch lines read; ``use`` sets
them for a block (tests, benchmarks/fused_kernels.py). Each fused path is tested against its torch
path (tests/unit/modeling/test_fused_kernels.py); benchmarks/fused_kernels.py times them on a GPU.
"""
from __future__ import annotations

import importlib
import importlib.util
from contextlib import contextmanager

import torch.nn as nn

from .verdicts import proven
from .config_base import ConfigError
from .expert_mlp import GroupedSwiGLU
from .rms_norm import rms_norm as rms_norm_torch

FUSED = {"cross_entropy": "liger", "rms_norm": "liger", "swiglu": "triton"}  # each kernel's fused name
UNMEASURED = ("not yet measured correct and faster on a GPU (vlm/modeling/gpu_verdicts.json, written by "
              "scripts/gpu/verdicts.py; name it to use it)")


def auto_on_cuda(table: dict | None = None) -> dict[str, str]:
    """What ``auto`` picks on CUDA where a kernel can run: its fused name where the GPU verdicts
    (``table``; None = gpu_verdicts.json) say correct and faster, else torch."""
    return {k: name if proven(f"fused_{k}_{name}", table) else "torch" for k, name in FUSED.items()}
PACKAGE = {"liger": "liger_kernel", "triton": "triton"}
DIST = {"liger": "liger-kernel (pip install -e '.[gpu]')", "triton": "triton"}

TORCH = {"rms_norm": rms_norm_torch, "swiglu": GroupedSwiGLU, "cross_entropy": None}  # (the loss: chunked_lm_loss)

ACTIVE = dict.fromkeys(FUSED, "torch")
IMPL: dict = dict(TORCH)  # what the dispatch lines call


class FusedKernelError(ConfigError):
    """A fused kernel asked for by name where it cannot run (one line; ``vlm.train`` exits 2)."""


def rms_norm(x, weight, eps: float):
    """RMSNorm through the active implementation (``rms_norm.rms_norm``'s figures)."""
    return IMPL["rms_norm"](x, weight, eps)


def _load(kernel: str, name: str):
    """The active implementation's callable (imported now: under TRITON_INTERPRET the tests' fresh modules)."""
    if name == "torch":
        return TORCH[kernel]
    if kernel == "swiglu":
        return importlib.import_module(f"{__package__}.expert_mlp_fused").GroupedSwiGLUFused
    ops = importlib.import_module(f"{__package__}.liger_ops")
    return ops.rms_norm if kernel == "rms_norm" else ops.linear_cross_entropy_sum


def _set(choices: dict[str, str]) -> None:
    for kernel, name in choices.items():
        if kernel not in FUSED or name not in ("torch", FUSED[kernel]):
            raise FusedKernelError(f"fused_kernels.{kernel}={name!r}: use torch or {FUSED.get(kernel)}")
        IMPL[kernel] = _load(kernel, name)
        ACTIVE[kernel] = name


@contextmanager
def use(**choices: str):
    """``ACTIVE`` set to ``choices`` (kernel=torch | its fused name) inside the block, put back after."""
    before = dict(ACTIVE)
    _set(choices)
    try:
        yield
    finally:
        _set(before)


def why_not(kernel: str, device: str, model: nn.Module | None = None, zero_stage: int = 0) -> str | None:
    """Why ``kernel``'s fused implementation cannot run here (None: it can)."""
    fused = FUSED[kernel]
    if device != "cuda":
        return f"the fused kernels run on CUDA, the device is {device}"
    if importlib.util.find_spec(PACKAGE[fused]) is None:
        return f"{DIST[fused]} is not installed"
    if kernel == "cross_entropy":
        if zero_stage == 3:
            return "ZeRO-3 gathers the LM head's weight only inside the head's own forward, which the fused loss skips"
        heads = [m.lm_head for m in (model.modules() if model is not None else ()) if hasattr(m, "logits_with_loss")]
        odd = [type(h).__name__ for h in heads if type(h) is not nn.Linear or h.bias is not None]
        if odd:
            return f"the LM head is a {odd[0]} (the fused loss takes a plain nn.Linear without bias: no LoRA on lm_head)"
    return None


def resolve(spec: dict[str, str], device: str, model: nn.Module | None = None,
            zero_stage: int = 0, table: dict | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """``spec`` (kernel -> auto | torch | fused name) -> (kernel -> torch | fused name, kernel -> why an
    ``auto`` took the torch path). A fused name that cannot run raises ``FusedKernelError``. ``table``:
    the GPU verdicts (None: gpu_verdicts.json)."""
    chosen, reasons = {}, {}
    measured = auto_on_cuda(table)
    for kernel, want in spec.items():
        if want not in ("auto", "torch", FUSED[kernel]):
            raise FusedKernelError(f"config error: train.fused_kernels.{kernel}={want!r}: use auto, torch or {FUSED[kernel]}")
        why = None if want == "torch" else why_not(kernel, device, model, zero_stage)
        if want == "auto":
            pick = measured[kernel] if why is None else "torch"
            if why is None and pick == "torch":
                why = UNMEASURED
            if why is not None:
                reasons[kernel] = why
            chosen[kernel] = pick
        elif why is not None:
            raise FusedKernelError(f"config error: train.fused_kernels.{kernel}={want}: {why}")
        else:
            chosen[kernel] = want
    return chosen, reasons


def configure(spec: dict[str, str], device: str, model: nn.Module | None = None, zero_stage: int = 0,
              log_line=print) -> dict[str, str]:
    """Resolves ``spec``, makes it active and says it in one line; returns the choice."""
    chosen, reasons = resolve(spec, device, model, zero_stage)
    _set(chosen)
    parts = [f"{k} {v}" + (f" (auto: {reasons[k]})" if k in reasons else "") for k, v in chosen.items()]
    if reasons and len(set(reasons.values())) == 1 and len(reasons) == len(chosen):
        parts = [f"torch paths for {', '.join(chosen)} (auto: {next(iter(reasons.values()))})"]
    log_line("[train] fused kernels: " + "; ".join(parts))
    return chosen
