"""``train.compile: true``: ``torch.compile`` on each transformer block of the model (the LM's token
and concept layers; a VLM's language model too), in place (``nn.Module.compile``), so parameter names,
state dicts and checkpoints are those of the eager model. Applied by the trainer after the model is
built and LoRA is injected (adapters inside a block are compiled with it).

Each block is one graph (``fullgraph=True``: attention, norms, routing, the experts' grouped GEMMs
and their backward; a graph break inside a block is an error, not a silent split), in fp32 too
(``vlm/modeling/grouped_mm.py``). Before each call the token dimension of the block's inputs is
marked dynamic (``mark_token_dim_dynamic``), so the first trace is already generic in the length
and packings of other lengths reuse it. What runs between the blocks (the document layout, the
chunker's concept count M, the concept merge, dechunk, the loss) stays eager: the layout and M are
host reads that shape what follows. On CPU inductor needs a C++ compiler; ``backend`` picks another
(``"eager"`` / ``"aot_eager"`` check the wiring without code generation).
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from vlm.modeling.blocks import TransformerBlock
from vlm.modeling.features import grouped_mm_ok, say_varlen
from vlm.modeling.grouped_mm import META_TRACEABLE
from vlm.modeling.varlen import DocLayout, kernel_for


def grouped_mm_traceable(dtype: torch.dtype) -> bool:
    """Whether torch's own meta function for ``torch._grouped_mm`` takes ``dtype`` (else, under
    compile, the experts call it through ``conceptmoe::grouped_mm``)."""
    return META_TRACEABLE.get(dtype, False)


def mark_token_dim_dynamic(args: tuple, kwargs: dict) -> None:
    """Marks dim 1 of every tensor argument [B, T, ...] whose dim 1 is the hidden states' T as
    dynamic (a hint: Dynamo may still specialise it where the code needs a constant)."""
    x_BTD = args[0] if args else kwargs["x_BTD"]
    T = x_BTD.shape[1]
    if T < 2:  # 0 / 1 are specialised by Dynamo anyway (decode steps)
        return
    for t in tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == T:
            torch._dynamo.maybe_mark_dynamic(t, 1)


def _eager_prelude(compiled, block: TransformerBlock):
    """Runs before each compiled call, outside the trace: the token dimension marked dynamic, the
    one-time ``grouped_mm_ok`` probe of the block's device and dtype (a real GEMM, which a trace
    cannot run; inside, the cached answer is a constant), and the flash path's log line (a logger call
    cannot be traced) when the block attends a document layout with it."""
    def call(*args, **kwargs):
        x_BTD = args[0] if args else kwargs["x_BTD"]
        grouped_mm_ok(x_BTD.device.type, x_BTD.dtype)
        if (isinstance(kwargs.get("mask"), DocLayout)
                and kernel_for(x_BTD.device, x_BTD.dtype, block.attn.head_dim, block.attn.varlen_kernel) == "flash"):
            say_varlen()
        mark_token_dim_dynamic(args, kwargs)
        return compiled(*args, **kwargs)
    return call


def compile_blocks(model: nn.Module, dtype: torch.dtype = torch.float32, backend="inductor",
                   dynamic: bool | None = None, fullgraph: bool = True) -> int:
    """``block.compile(fullgraph=...)`` for every ``TransformerBlock`` in ``model`` (trained in
    ``dtype``; any dtype traces), each call's token dimension marked dynamic; returns how many."""
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    for block in blocks:
        block.compile(backend=backend, dynamic=dynamic, fullgraph=fullgraph)
        # Module.__call__ calls _compiled_call_impl: the prelude runs there, before the trace
        block._compiled_call_impl = _eager_prelude(block._compiled_call_impl, block)
    return len(blocks)
