"""Full weights where the trainer holds shards: the state dict gathered over ZeRO-3 partitions and
expert-parallel groups, a fresh unsharded model holding it (the export, and what rank 0 scores alone
under ZeRO-3 / expert parallelism, where its shard cannot run without the other ranks)."""
from __future__ import annotations

import torch

from vlm.modeling.vision_hub import load_line_muted, log_load
from vlm.modeling.safe_loading import load_state_dict_checked
from vlm.training import lora
from vlm.training.expert_parallel import full_state_dict, is_expert_parallel
from vlm.training.build import build_model
from vlm.training.state import RunContext


def gather_state(ctx: RunContext) -> dict | None:
    """Collective: the full fp32 state dict on CPU on rank 0 (None on the others): ZeRO-3 partitions
    gathered, expert-parallel experts gathered and named as in the unsharded model."""
    module = ctx.module
    if ctx.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return _fp32_cpu(module.state_dict()) if ctx.is_main else None
    if is_expert_parallel(module):  # collective: each expert-parallel group gathers its experts
        full = full_state_dict(module)
        return _fp32_cpu(full) if ctx.is_main else None
    return _fp32_cpu(module.state_dict()) if ctx.is_main else None


def _fp32_cpu(state: dict) -> dict:
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}


def unsharded_model(ctx: RunContext, state: dict, log_vision: bool = True):
    """Rank 0: a fresh, unsharded model holding ``state`` (LoRA adapters merged). The vision tower's
    load line names this run's trained weights (``log_vision``; the fresh build's random init, replaced
    at once, logs none)."""
    # the fresh build's random init must not move this rank's RNG streams (the chunker's boundary noise of
    # the next training steps draws from them): an in-training eval or picture leaves training as it was
    with load_line_muted(), torch.random.fork_rng(devices=[]):
        fresh = build_model(ctx.model_config, ctx.cfg.model.kind)
    if ctx.cfg.train.lora:  # the same adapters, loaded, then merged: a plain model with no peft keys
        lora.inject(fresh, ctx.cfg.train.lora)
    missing, unexpected = load_state_dict_checked(fresh, state)
    if missing or unexpected:
        raise RuntimeError(f"export: state dict mismatch (missing {missing[:5]}, unexpected {unexpected[:5]})")
    if ctx.cfg.train.lora:
        lora.merge(fresh)
    vision = getattr(fresh, "vision", None)
    if log_vision and getattr(vision, "load_what", None):
        vision.load_line = log_load(vision, vision.load_what, f"the weights trained in run {ctx.cfg.name}")
    return fresh


def scoring_model(ctx: RunContext):
    """Collective under ZeRO-3 / expert parallelism: a model rank 0 can run alone, on rank 0 (None on
    the others): the live module on ZeRO-1/2 (full weights on every rank), else an unsharded copy of
    the gathered weights (rank 0's shard would wait for the other ranks: the MoE all-to-all, ZeRO-3's
    parameter gathers)."""
    if ctx.zero_stage != 3 and not is_expert_parallel(ctx.module):
        return ctx.module if ctx.is_main else None
    state = gather_state(ctx)
    return unsharded_model(ctx, state, log_vision=False).to(ctx.model_device) if ctx.is_main else None
