"""ZeRO-3 preparation: which modules are gathered whole (leaf modules) and which parameters are
read outside their module's forward (external parameters)."""
from __future__ import annotations

import torch


def _input_requires_grad(module, args, kwargs):
    """Forward pre-hook: make the first tensor input require grad (see ``prepare_zero3``)."""
    if args and torch.is_tensor(args[0]) and args[0].is_floating_point() and not args[0].requires_grad:
        args = (args[0].detach().requires_grad_(True), *args[1:])
    return args, kwargs


def prepare_zero3(model) -> None:
    """Leaf modules for ZeRO-3. ``MoEFeedForward``: all its experts are gathered when the block
    runs, so ranks whose tokens routed to different experts still issue identical all-gathers (no
    desynchronised collectives, no hang). The vision tower: timm ViTs use their own position /
    class tokens outside a submodule's forward.

    DeepSpeed reduces a leaf module's gradients from a full backward hook on that module; when no
    input of the module requires grad (the vision tower reads raw pixels) that hook fires as soon
    as the gradients w.r.t. its OUTPUTS exist, i.e. before the tower's own backward, and the
    gradient accumulation then hits released (size-0) parameters. So a trainable vision tower gets
    a pre-hook that makes its pixel input require grad (a negligible extra gradient)."""
    from deepspeed.utils import set_z3_leaf_modules

    from vlm.modeling.moe import MoEFeedForward

    leaves = [MoEFeedForward]
    vision = getattr(model, "vision", None)
    if vision is not None:
        leaves.append(type(vision))
        if any(p.requires_grad for p in vision.parameters()):
            vision.register_forward_pre_hook(_input_requires_grad, with_kwargs=True)
    set_z3_leaf_modules(model, leaves)


def register_zero3_external(engine_module) -> None:
    """The chunker's W_q / W_k are read by ``ConceptMoEModel`` (not through the chunker's own
    forward), so ZeRO-3 would never gather them. Register them as external parameters of the
    causal-LM wrapper: gathered in its forward and, because its output (a ModelOutput, i.e. a dict)
    carries the loss, again from the start of its backward until its inputs' gradients are done --
    which includes the chunker's backward. (The backbone itself returns a plain dataclass, which
    DeepSpeed cannot hook for the backward pass.)"""
    import deepspeed

    lm = getattr(engine_module, "language_model", engine_module)
    backbone = getattr(lm, "model", None)
    chunker = getattr(backbone, "chunker", None) if backbone is not None else None
    if chunker is not None:
        for p in chunker.parameters():
            deepspeed.zero.register_external_parameter(lm, p)
