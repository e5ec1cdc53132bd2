"""``prepare_model``: the in-place changes that make a built model (``build.setup_model``) ready for
the DeepSpeed engine, in one order:

1. freeze / LoRA (``optim.apply_freeze``, ``lora.apply``): the adapters replace linear layers inside
   the blocks, so everything after sees the final modules, and the trainable flags are set before
   anything reads them;
2. loss-only (``modeling_conceptmoe.loss_only``): training reads the losses and boundaries, never logits
   (chunked CE, no [B, T, V]); the fused kernels (``train.fused_kernels``, vlm/modeling/fused_kernels.py)
   chosen for the device, the LM head (LoRA'd or not) and the ZeRO stage; the model's runtime choices
   (``model.runtime.*``, vlm/modeling/runtime.py) said in one line, ``auto`` resolved for the device;
3. recompute (``activation_checkpointing``): the checkpoint call sits in the block's forward ...
4. ... so ``compile`` (``train.compile``) traces it with the block (and the LoRA adapters);
5. expert parallelism (``expert_parallel``): each MoE layer keeps this rank's experts (the parameter
   counts are taken before, over the whole model);
6. ZeRO-3 leaves (``zero3.prepare_zero3``): on the final module types, with the vision tower's
   trainable flag known. Expert parallelism and ZeRO-3 exclude each other (``check_supported``).

After ``deepspeed.initialize`` the trainer registers ZeRO-3's external parameters on the engine's
module (``zero3.register_zero3_external``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from vlm.config.train import TrainConfig
from vlm.modeling import fused_kernels, runtime
from vlm.modeling.conceptmoe import ConceptMoEModel
from vlm.modeling.modeling_conceptmoe import loss_only
from vlm.training import lora, optim
from vlm.training.activation_checkpointing import apply_activation_checkpointing
from vlm.training.compile import compile_blocks
from vlm.training.expert_parallel import apply_expert_parallel, check_supported
from vlm.training.zero3 import prepare_zero3


@dataclass(frozen=True)
class ParamCounts:
    """Parameters per part (``optim.PARTS``) of the whole model: all of them, and those that train."""

    total: dict[str, int]
    trainable: dict[str, int]


def prepare_model(model: nn.Module, cfg: TrainConfig, *, zero_stage: int, world_size: int, dtype: torch.dtype,
                  log_line: Callable[[str], None] = print, device: str = "cpu") -> ParamCounts:
    """Steps 1-6 above on ``model``, in place, each that applies logging one line where it says more
    than the config."""
    trainable = optim.trainable_parts(cfg)
    trainable_counts = (lora.apply(model, cfg, trainable, log_line) if cfg.train.lora
                        else optim.apply_freeze(model, trainable))
    loss_only(model)
    fused_kernels.configure(cfg.train.fused_kernels.model_dump(), device, model, zero_stage, log_line)
    backbone = next(m for m in model.modules() if isinstance(m, ConceptMoEModel))
    log_line("[train] " + runtime.resolved(backbone.cfg.runtime, device))
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    ep_size = cfg.parallel.expert_parallel_size
    if cfg.train.compile:
        # the expert-parallel exchange reads its split sizes on the host: a graph break in each MoE block
        n = compile_blocks(model, dtype, fullgraph=ep_size == 1)
        log_line(f"[train] train.compile: {n} transformer blocks compiled (torch.compile, "
                 + ("one graph each)" if ep_size == 1 else "graph breaks at the expert-parallel exchange)"))
    counts = ParamCounts(total=optim.count_params(model), trainable=trainable_counts)
    if ep_size > 1:
        check_supported(cfg, world_size, model, zero_stage)
        n = apply_expert_parallel(model, ep_size)
        log_line(f"[train] expert parallelism: the experts of {n} MoE layers sharded over groups of "
                 f"{ep_size} ranks (dropless all-to-all)")
    if zero_stage == 3:
        prepare_zero3(model)
    return counts
