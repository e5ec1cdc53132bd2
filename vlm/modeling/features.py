"""Which torch APIs this install offers, detected by feature, never by version string.

The code accepts torch 2.11 to 2.14 (and transformers 5.17 to 5.25). Where an API differs inside
that range, a probe here decides once per process, and the first use logs one line naming the path
taken (``report`` lists them all: scripts/gpu/environment.py prints it before the GPU check).

* ``varlen_attn``: causal masking by ``window_size=(-1, 0)`` (or an older ``is_causal=True``);
  grouped-query attention natively by ``enable_gqa=True`` where the signature has it (torch 2.12+),
  else K / V heads repeated to the query heads before the call.
* ``torch._grouped_mm``: whether one call works for a (device type, dtype), probed on a tiny input
  and compared with per-expert matmuls; where it does not, the MoE takes its per-expert split.
* ``FlopCounterMode`` on grouped-query SDPA: torch's formula where it takes the shapes, else ours
  (the benchmarks' FLOP checks).
"""
from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _disable_current_modes

from . import hf_features

log = logging.getLogger("vlm.features")
_logged: set[str] = set()


def _say(key: str, line: str) -> None:
    """Logs ``line`` once per process; nothing while Dynamo traces (a logger call there stops a fullgraph
    trace: say it before, as ``say_varlen`` in train.compile's prelude)."""
    if torch.compiler.is_compiling():
        return
    if key not in _logged:
        _logged.add(key)
        log.info("features: %s", line)


@dataclass(frozen=True)
class VarlenAPI:
    causal_kwargs: dict          # the keyword(s) that make varlen_attn causal
    native_gqa: bool             # varlen_attn takes enable_gqa=True (else repeat K / V heads)

    def describe(self) -> str:
        causal = ", ".join(f"{k}={v}" for k, v in self.causal_kwargs.items())
        gqa = "enable_gqa=True" if self.native_gqa else "K/V heads repeated (no enable_gqa)"
        return f"varlen_attn({causal}), {gqa}"


_VARLEN: list = []  # varlen_api's answer once probed: a traced call reads it (Dynamo would trace a cache wrapper's body)


def varlen_api() -> VarlenAPI | None:
    """How to call ``torch.nn.attention.varlen.varlen_attn`` causally here; None: it is missing (probed once)."""
    if not _VARLEN:
        _VARLEN.append(_probe_varlen_api())
    return _VARLEN[0]


varlen_api.cache_clear = _VARLEN.clear  # (tests: probe again, e.g. after replacing varlen_attn)


def _probe_varlen_api() -> VarlenAPI | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return VarlenAPI(causal, "enable_gqa" in params)


def say_varlen() -> None:
    """The flash path's log line (once per process): at its first eager call, or before a compiled one."""
    if not torch.compiler.is_compiling():
        _say("varlen", varlen_api().describe())


def varlen_call(q_NHD, k_NHD, v_NHD, cu_seq, max_len: int):
    """Causal varlen attention over documents ``cu_seq`` with the API this torch has."""
    from torch.nn.attention.varlen import varlen_attn
    api = varlen_api()
    say_varlen()
    if api.native_gqa:
        return varlen_attn(q_NHD, k_NHD, v_NHD, cu_seq, cu_seq, max_len, max_len, enable_gqa=True,
                           **api.causal_kwargs)
    rep = q_NHD.shape[1] // k_NHD.shape[1]
    if rep > 1:
        k_NHD, v_NHD = (x.repeat_interleave(rep, dim=1) for x in (k_NHD, v_NHD))
    return varlen_attn(q_NHD, k_NHD, v_NHD, cu_seq, cu_seq, max_len, max_len, **api.causal_kwargs)


_GROUPED: dict[tuple[str, torch.dtype], bool] = {}


@torch.compiler.disable
def _probe_grouped_mm(device_type: str, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    dev = torch.device(device_type)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=gen).to(dev, dtype)
    w = torch.randn(2, 16, 16, generator=gen).to(dev, dtype)
    offs = torch.tensor([24, 64], dtype=torch.int32, device=dev)
    try:
        y = torch._grouped_mm(x, w, offs=offs)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    ref = torch.cat([x[:24] @ w[0], x[24:] @ w[1]])
    return bool(torch.allclose(y.float(), ref.float(), atol=0.1, rtol=0.05))


def grouped_mm_ok(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` serves the MoE on this device type and dtype (probed once, on
    first use). The probe runs outside any active dispatch mode and without autograd: a mode the
    caller holds (``FlopCounterMode``, a fake-tensor mode) sees only the caller's work, not the
    probe's matmuls."""
    key = (device_type, dtype)
    if key not in _GROUPED:
        with _disable_current_modes(), torch.no_grad():
            ok = _probe_grouped_mm(device_type, dtype)
        _GROUPED[key] = ok
        _say(f"gmm-{key}", f"torch._grouped_mm on {device_type} {str(dtype).removeprefix('torch.')}: "
             + ("one grouped GEMM per projection" if ok else "not available, per-expert split"))
    return _GROUPED[key]


def _gqa_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """Forward FLOPs of SDPA with K / V heads shared by query heads: Q K^T and P V per query head."""
    b, h, s_q, d_q = query_shape
    s_k, d_v = key_shape[-2], value_shape[-1]
    return 2 * b * h * s_q * s_k * d_q + 2 * b * h * s_q * s_k * d_v


@functools.cache
def sdpa_flop_formulas() -> dict:
    """``FlopCounterMode(custom_mapping=...)`` entries for the forward SDPA kernels where torch's own
    formula refuses grouped-query shapes (torch 2.11: 'query/key/value shapes are incompatible');
    {} where it counts them."""
    from torch.utils import flop_counter
    try:
        flop_counter.sdpa_flop_count((1, 4, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16))
        _say("sdpa-flops", "FlopCounterMode counts grouped-query SDPA itself")
        return {}
    except AssertionError:
        _say("sdpa-flops", "FlopCounterMode's SDPA formula refuses grouped-query shapes: our forward formula")
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    return {getattr(aten, n): _gqa_sdpa_flop for n in names if hasattr(aten, n)}


def report(device: torch.device) -> list[str]:
    """One line per feature-detected path on ``device`` (the training dtypes)."""
    api = varlen_api()
    lines = [f"torch {torch.__version__}: " + (api.describe() if api else "no usable varlen_attn: "
                                                "bucketed SDPA for packed rows on CUDA")]
    dtypes = (torch.bfloat16, torch.float32) if device.type == "cuda" else (torch.float32,)
    for dtype in dtypes:
        ok = grouped_mm_ok(device.type, dtype)
        lines.append(f"torch._grouped_mm {device.type} {str(dtype).removeprefix('torch.')}: "
                     + ("grouped GEMM" if ok else "per-expert split"))
    lines.append("FlopCounterMode, grouped-query SDPA: " + ("torch's formula" if not sdpa_flop_formulas()
                                                             else "our forward formula (torch's refuses the shapes)"))
    lines += hf_features.report()
    return lines
