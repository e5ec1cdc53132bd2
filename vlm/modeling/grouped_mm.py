"""``torch._grouped_mm`` as ``torch.compile`` can trace it in every dtype the device runs.

Torch's meta (shape) function for ``_grouped_mm`` accepts bf16 / fp16 only, although the CPU kernel
runs fp32 too: Dynamo stops at an fp32 call (a graph break, or an error under ``fullgraph``). Under
compile, a dtype the meta function refuses goes through ``conceptmoe::grouped_mm``, a custom op whose
fake function gives the output shape and whose kernel is the same ``torch._grouped_mm`` (contiguous
output, as the fake one says); dtypes it accepts stay on the aten op (inductor has its own lowering
for it on CUDA). Eager calls are never rerouted: no dispatch overhead outside compile.
"""
from __future__ import annotations

import torch


def _meta_accepts(dtype: torch.dtype) -> bool:
    """Whether torch's meta function for ``_grouped_mm`` takes ``dtype`` (a shape-only call)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        torch._grouped_mm(torch.empty(4, 16, device="meta", dtype=dtype),
                          torch.empty(2, 16, 16, device="meta", dtype=dtype),
                          offs=torch.empty(2, dtype=torch.int32, device="meta"))
    except RuntimeError:
        return False
    return True


# decided at import: Dynamo reads this constant instead of tracing a probe
META_TRACEABLE = {dt: _meta_accepts(dt) for dt in (torch.float32, torch.bfloat16, torch.float16)}


def _out_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> list[int]:
    """``torch._grouped_mm``'s output shape (the four layouts of its meta function)."""
    if a.dim() == 2 and b.dim() == 3:  # [M, K] x [G, K, N] -> [M, N], M jagged
        return [a.shape[0], b.shape[-1]]
    if a.dim() == 3 and b.dim() == 2:  # [G, M, K] x [K, N] -> [M, N], N jagged
        return [a.shape[1], b.shape[1]]
    if a.dim() == 2:  # [M, K] x [K, N] -> [G, M, N], K jagged (weight gradients)
        return [offs.shape[0], a.shape[0], b.shape[1]]
    return [a.shape[0], a.shape[1], b.shape[-1]]


def _define_op():
    """``conceptmoe::grouped_mm`` (defined once per process, also when this file is loaded twice, as
    the exported model's remote code beside the installed package)."""
    if hasattr(torch.ops.conceptmoe, "grouped_mm"):
        return torch.ops.conceptmoe.grouped_mm

    @torch.library.custom_op("conceptmoe::grouped_mm", mutates_args=())
    def grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(a, b, offs=offs).contiguous()

    @grouped_mm_op.register_fake
    def _(a, b, offs):
        return a.new_empty(_out_shape(a, b, offs))

    return torch.ops.conceptmoe.grouped_mm


_OP = _define_op() if hasattr(torch, "_grouped_mm") else None


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)``; traceable by Dynamo in fp32 too (see above)."""
    if torch.compiler.is_compiling() and not META_TRACEABLE.get(a.dtype, False):
        return _OP(a, b, offs)
    return torch._grouped_mm(a, b, offs=offs)
