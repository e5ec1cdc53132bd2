"""``train.compile: true``: ``torch.compile`` on each transformer block of the model (the LM's token
and concept layers; a VLM's language model too), in place (``nn.Module.compile``), so parameter names,
state dicts and checkpoints are those of the eager model. Applied by the trainer after the model is
built and LoRA is injected (adapters inside a block are compiled with it).

What runs between the blocks (chunker, concept merge, dechunk, the loss) stays eager, and so does
what a block hands to the host (the varlen document layout, the decoding KV cache): Dynamo breaks
the graph there. The MoE's grouped GEMM (``torch._grouped_mm``) has a meta (shape) function for
bf16 only in this torch: in fp32 the experts (``MoEFeedForward.experts_sorted``) run eager, routing,
attention, norms and dense FFNs compiled. On CPU inductor needs a C++ compiler; ``backend`` picks
another (``"eager"`` / ``"aot_eager"`` check the wiring without code generation).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from vlm.modeling.blocks import TransformerBlock


def grouped_mm_traceable(dtype: torch.dtype) -> bool:
    """Whether Dynamo can trace ``torch._grouped_mm`` in ``dtype`` (its meta function accepts it)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        torch._grouped_mm(torch.empty(4, 16, device="meta", dtype=dtype),
                          torch.empty(2, 16, 16, device="meta", dtype=dtype),
                          offs=torch.empty(2, dtype=torch.int32, device="meta"))
    except RuntimeError:
        return False
    return True


def compile_blocks(model: nn.Module, dtype: torch.dtype = torch.float32, backend: str = "inductor",
                   dynamic: bool | None = None) -> int:
    """``block.compile(...)`` for every ``TransformerBlock`` in ``model`` (trained in ``dtype``);
    returns how many."""
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    eager_experts = not grouped_mm_traceable(dtype)
    for block in blocks:
        if eager_experts and block.is_moe:
            block.ffn.experts_sorted = torch.compiler.disable(block.ffn.experts_sorted)
        block.compile(backend=backend, dynamic=dynamic)
    return len(blocks)
