"""Model parts, stage freezing, AdamW parameter groups and the warmup + cosine schedule for the
trainer (``train.stage``, ``train.freeze``, ``train.lr_mult`` of the training config)."""
from __future__ import annotations

import math
from collections import Counter

import torch
from torch import nn

# Every parameter belongs to exactly one part: vision (the vision tower, ``model.vision``),
# projector (vision -> LM), chunker (the ConceptMoE boundary router, ``...model.chunker``: W_q, W_k)
# or lm (the rest of the language model: embeddings, layers, concept projections, LM head).
PARTS = ("vision", "projector", "chunker", "lm")
# The parts each ``train.stage`` trains (``train.freeze.<part>`` true / false overrides).
STAGE_TRAINABLE = {
    "align": {"projector"},
    "finetune": {"projector", "chunker", "lm"},
    "full": {"vision", "projector", "chunker", "lm"},
}
NO_DECAY_NAME_HINTS = ("pos_embed", "cls_token", "reg_token", "dist_token", "position_embedding",
                       "class_embedding", "embed_tokens")


def _prefix_of(model: nn.Module, target: nn.Module | None) -> str | None:
    if target is None:
        return None
    for name, mod in model.named_modules():
        if mod is target:
            return name + "." if name else ""
    return None


def part_prefixes(model: nn.Module) -> dict[str, str | None]:
    """Name prefix of each part in ``model.named_parameters()`` (None when absent)."""
    lm = getattr(model, "language_model", model)
    backbone = getattr(lm, "model", None)
    return {"vision": _prefix_of(model, getattr(model, "vision", None)),
            "projector": _prefix_of(model, getattr(model, "projector", None)),
            "chunker": _prefix_of(model, getattr(backbone, "chunker", None) if backbone is not None else None)}


def param_parts(model: nn.Module) -> dict[str, str]:
    """Parameter name -> part."""
    pref = part_prefixes(model)
    out = {}
    for name, _ in model.named_parameters():
        part = "lm"
        for p in ("vision", "projector", "chunker"):
            if pref[p] is not None and name.startswith(pref[p]):
                part = p
                break
        out[name] = part
    return out


def trainable_parts(cfg) -> set[str]:
    """The parts that train: the stage's set, adjusted by train.freeze.<part>."""
    parts = set(STAGE_TRAINABLE[cfg.train.stage])
    for part in PARTS:
        flag = getattr(cfg.train.freeze, part)
        if flag is True:
            parts.discard(part)
        elif flag is False:
            parts.add(part)
    return parts


def apply_freeze(model: nn.Module, trainable: set[str]) -> dict[str, int]:
    """Set requires_grad per part; returns trainable parameter counts per part."""
    parts = param_parts(model)
    counts: Counter = Counter()
    for name, p in model.named_parameters():
        p.requires_grad_(parts[name] in trainable)
        if p.requires_grad:
            counts[parts[name]] += p.numel()
    return {part: counts.get(part, 0) for part in PARTS}


def count_params(model: nn.Module, trainable_only: bool = False) -> dict[str, int]:
    parts = param_parts(model)
    counts: Counter = Counter()
    for name, p in model.named_parameters():
        if not trainable_only or p.requires_grad:
            counts[parts[name]] += _numel(p)
    return {part: counts.get(part, 0) for part in PARTS}


def _numel(p: torch.Tensor) -> int:
    return int(getattr(p, "ds_numel", p.numel()))  # ZeRO-3 keeps the full size in ds_numel


def no_decay_names(model: nn.Module) -> set[str]:
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    out = set()
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        shape = getattr(p, "ds_shape", p.shape)
        if len(shape) < 2 or id(p) in embedding_params or leaf == "bias" \
                or any(h in name for h in NO_DECAY_NAME_HINTS):
            out.add(name)
    return out


def param_groups(model: nn.Module, cfg) -> list[dict]:
    """AdamW groups per (part, decay) over trainable parameters, with ``lr = train.lr *
    lr_mult.<part>``. No weight decay on biases, norm weights (< 2 dims), embeddings
    (``nn.Embedding`` weights) and ViT position / class / register tokens."""
    parts = param_parts(model)
    nd = no_decay_names(model)
    groups: dict[tuple[str, bool], list] = {}
    names: dict[tuple[str, bool], list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        key = (parts[name], name not in nd)
        groups.setdefault(key, []).append(p)
        names.setdefault(key, []).append(name)
    out = []
    for (part, decay) in sorted(groups, key=lambda k: (PARTS.index(k[0]), not k[1])):
        mult = float(getattr(cfg.train.lr_mult, part))
        out.append({"params": groups[(part, decay)], "lr": cfg.train.lr * mult,
                    "weight_decay": cfg.train.weight_decay if decay else 0.0,
                    "name": f"{part}/{'decay' if decay else 'no_decay'}", "part": part,
                    "param_names": names[(part, decay)]})
    if not out:
        raise ValueError("no trainable parameters: check train.stage and train.freeze")
    return out


def build_optimizer(model: nn.Module, cfg) -> torch.optim.AdamW:
    """torch's fused AdamW on every device: one kernel per flat ZeRO partition (the per-tensor loop launches
    ~10 per partition), and no host read of the step count."""
    groups = param_groups(model, cfg)
    torch_groups = [{k: v for k, v in g.items() if k != "param_names"} for g in groups]
    if any(getattr(p, "allreduce", True) is False for g in torch_groups for p in g["params"]):
        # sharded experts (expert parallelism): DeepSpeed's MoE groups, named after their expert-parallel
        # group, which ZeRO partitions and reduces over the expert-data-parallel group
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        torch_groups = split_params_into_different_moe_groups_for_optimizer(torch_groups)
    return torch.optim.AdamW(torch_groups, lr=cfg.train.lr, betas=tuple(cfg.train.betas), eps=cfg.train.eps,
                             weight_decay=cfg.train.weight_decay, fused=True)


class WarmupCosine:
    """LR multiplier at scheduler step ``s`` (0-based: s optimizer steps already applied): linear
    warmup from 1/warmup to 1 over ``warmup_steps``, then cosine down to ``min_ratio`` at
    ``max_steps`` (flat after)."""

    def __init__(self, warmup_steps: int, max_steps: int, min_ratio: float):
        self.warmup_steps, self.max_steps, self.min_ratio = int(warmup_steps), int(max_steps), float(min_ratio)

    def __call__(self, s: int) -> float:
        if self.warmup_steps > 0 and s < self.warmup_steps:
            return (s + 1) / self.warmup_steps
        span = max(1, self.max_steps - self.warmup_steps)
        progress = min(1.0, (s - self.warmup_steps) / span)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def scheduler_factory(cfg):
    """A callable that DeepSpeed calls with the (client) optimizer to build the LambdaLR. LambdaLR
    multiplies each group's own lr, so the per-part multipliers survive; DeepSpeed steps it once
    per applied optimizer step (a skipped, non-finite step does not advance it)."""
    fn = WarmupCosine(cfg.train.warmup_steps, cfg.train.max_steps, cfg.train.min_lr_ratio)

    def make(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)

    return make
