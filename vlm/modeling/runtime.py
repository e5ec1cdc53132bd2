"""The model's runtime choices (``ConceptMoEConfig.runtime``): how it computes, never what it computes.

Each choice has a reference path and, where one exists, a faster path that ``auto`` takes on CUDA only
where the GPU check measured it correct and faster (``gpu_verdicts.json``, read by ``verdicts.py``).
Set in a model preset (``runtime: {capacity: exact}``), a training override (``model.runtime.capacity=exact``)
or on a live config (``model.config.runtime.capacity = "exact"``, validated on assignment). Not saved in
exports: a loaded model starts from these defaults. Each model holds its own, so two models differ."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, ValidationError, field_validator

from .config_base import NonNegInt, Section, build, check, error_from
from .linear_scan import auto_impl
from .verdicts import proven

CAPACITIES = ("auto", "tokens", "exact")
VARLEN_KERNELS = ("auto", "loop", "bucketed", "cuda")
ATTENTION_IMPLS = ("varlen", "dense")
SCAN_IMPLS = ("auto", "torch", "triton")


class RuntimeOptions(Section):
    """Per model; ``auto`` is resolved at run time from the device and the GPU verdicts."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, arbitrary_types_allowed=True)

    # the concept sequence's length M: "tokens" = the capacity T (a host bound: no read of the concept
    # count, static shapes, the concept layers run on T slots), "exact" = the longest row's count (one
    # read of the device), "auto" = "tokens" on CUDA for batches with a host-built document layout once the
    # GPU check marked it correct and faster (verdict ``capacity_tokens``), else "exact"
    capacity: Literal[CAPACITIES] = "auto"
    # the document-attention kernel (varlen.py): "auto" = flash where it applies, else loop on the CPU,
    # else bucketed; "loop" (CPU only) / "bucketed" force one; "cuda": auto's choice on CUDA, on any device
    # (flash through a stand-in of varlen_attn on the CPU: the CPU harness of the CUDA branches)
    varlen_kernel: Literal[VARLEN_KERNELS] = "auto"
    # packed / padded rows: "varlen" = per-document kernels, "dense" = the T x T reference mask
    attention: Literal[ATTENTION_IMPLS] = "varlen"
    # the dechunk EMA scan (linear_scan.py): "auto" = the Triton kernel on CUDA once the GPU check marked it
    # correct and faster (verdict ``ema_scan_triton``), else the torch chunked scan
    ema_scan: Literal[SCAN_IMPLS] = "auto"
    # torch.compile's backend for generate(decode="compiled"): a backend name or a callable (tests)
    decode_compile_backend: Any = "inductor"
    # concept-cache slots beyond capacity / R at decoding (forced boundaries: segment / modality starts)
    concept_headroom: NonNegInt = 16

    def __setattr__(self, name: str, value: Any) -> None:
        try:  # validated on assignment: a bad value is one line naming runtime.<key>
            super().__setattr__(name, value)
        except ValidationError as err:
            raise error_from(err, type(self), "runtime.") from None

    @field_validator("decode_compile_backend")
    @classmethod
    def _backend(cls, value: Any) -> Any:
        if not (callable(value) or (isinstance(value, str) and value.strip())):
            raise ValueError("must be a torch.compile backend name or a callable")
        return value


def runtime_options(value: Any) -> RuntimeOptions:
    """A ``RuntimeOptions`` from None (defaults), a mapping (validated: one-line errors naming
    ``runtime.<key>``) or itself (a copy, so that two configs never share one)."""
    if isinstance(value, RuntimeOptions):
        return value.model_copy()
    check(value is None or isinstance(value, dict), "runtime", f"must be a mapping, got {value!r}")
    return build(RuntimeOptions, value, "runtime.")


def use_tokens_capacity(opts: RuntimeOptions, host_layout: bool, device_type: str, table: dict | None = None) -> bool:
    """Whether the concept sequence runs at the capacity T (see ``RuntimeOptions.capacity``)."""
    if opts.capacity != "auto":
        return opts.capacity == "tokens"
    return host_layout and device_type == "cuda" and proven("capacity_tokens", table)


def scan_impl(opts: RuntimeOptions, device_type: str, table: dict | None = None) -> str:
    """The EMA scan to run on ``device_type``: torch | triton (``auto`` resolved, see ``RuntimeOptions``)."""
    if opts.ema_scan != "auto":
        return opts.ema_scan
    return auto_impl(device_type, table)


def resolved(opts: RuntimeOptions, device_type: str, table: dict | None = None) -> str:
    """The one log line of a run: every choice, ``auto`` with what it picks on this device."""
    cap = "tokens" if use_tokens_capacity(opts, True, device_type, table) else "exact"
    parts = []
    for key, value in opts.__dict__.items():
        text = value if isinstance(value, (str, int)) else type(value).__name__
        if key == "capacity" and value == "auto":
            text = f"auto ({cap} for host-laid-out batches)"
        elif key == "ema_scan" and value == "auto":
            text = f"auto ({scan_impl(opts, device_type, table)})"
        parts.append(f"{key}={text}")
    return "runtime (model.runtime.*): " + ", ".join(parts)
