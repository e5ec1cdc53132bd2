"""LoRA on the language model (``train.lora``) through peft: adapters are injected into the LM's
``nn.Linear`` layers named by ``target_modules`` right after the model is built, the lm part then
trains only them (the other parts follow ``train.stage`` / ``train.freeze``), DeepSpeed checkpoints
carry them in the module state dict, and the export merges them (peft's own layer merge) into a plain
model with no peft keys.

Targets are leaf names (``q_proj``) or dotted tails (``attn.o_proj``) of ``nn.Linear`` modules of the
language model, matched as peft matches them (the whole name or a ``.``-separated tail). The chunker
(its router reads ``q_proj.weight`` / ``k_proj.weight`` directly) and the LM head (tied to the
embeddings) are never adapted; the MoE experts are stacked parameters, not ``nn.Linear``."""
from __future__ import annotations

from torch import nn

from vlm.modeling.config_base import ConfigError
from vlm.training import optim

ADAPTER = "default"


def language_model(model: nn.Module) -> nn.Module:
    """The LM inside a VLM (``model.language_model``), or the LM itself."""
    return getattr(model, "language_model", model)


def _candidates(lm: nn.Module) -> list[str]:
    """Names (relative to ``lm``) of the linear layers LoRA may adapt."""
    backbone = getattr(lm, "model", None)
    chunker = getattr(backbone, "chunker", None)
    skip = {id(m) for m in chunker.modules()} if chunker is not None else set()
    skip.add(id(getattr(lm, "lm_head", None)))
    return [name for name, mod in lm.named_modules() if isinstance(mod, nn.Linear) and id(mod) not in skip]


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def resolve_targets(lm: nn.Module, targets: list[str]) -> list[str]:
    """The full module names the targets match; a target that matches none is one line."""
    names = _candidates(lm)
    for target in targets:
        if not any(_matches(n, target) for n in names):
            leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
            raise ConfigError(f"config error: train.lora.target_modules: {target!r} matches no linear layer of the "
                              f"language model (chunker and lm_head excluded; linear layers: {', '.join(leaves)})")
    return [n for n in names if any(_matches(n, t) for t in targets)]


def inject(model: nn.Module, lora_cfg) -> list[str]:
    """Add LoRA adapters (peft ``inject_adapter_in_model``) to the LM of ``model``, in place; returns
    the adapted module names (relative to the LM)."""
    from peft import LoraConfig, inject_adapter_in_model

    lm = language_model(model)
    names = resolve_targets(lm, list(lora_cfg.target_modules))
    config = LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                        target_modules=names, bias="none")
    inject_adapter_in_model(config, lm, adapter_name=ADAPTER)
    return names


def is_lora_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def apply(model: nn.Module, cfg, trainable: set[str], log_line=print) -> dict[str, int]:
    """``train.lora``: inject the adapters, freeze per part (``optim.apply_freeze``), then freeze every
    lm parameter except the adapters. Returns the trainable counts per part; logs one line."""
    if "lm" not in trainable:
        raise ConfigError(f"config error: train.lora: the lm part does not train in stage {cfg.train.stage!r} "
                          "(use stage finetune / full or train.freeze.lm: false)")
    names = inject(model, cfg.train.lora)
    optim.apply_freeze(model, trainable)
    parts = optim.param_parts(model)
    for name, p in model.named_parameters():
        if parts[name] == "lm":
            p.requires_grad_(is_lora_param(name))
    counts = optim.count_params(model, trainable_only=True)
    n_lora = sum(p.numel() for n, p in model.named_parameters() if is_lora_param(n))
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    lc = cfg.train.lora
    log_line(f"[train] LoRA r={lc.r} alpha={lc.alpha:g} dropout={lc.dropout:g} on {len(names)} linear layers of the "
             f"language model ({', '.join(leaves)}): {n_lora:,} adapter parameters; trainable {sum(counts.values()):,} "
             f"(" + ", ".join(f"{p} {counts[p]:,}" for p in optim.PARTS if counts[p]) + ")")
    return counts


def merge(model: nn.Module) -> nn.Module:
    """Merge every LoRA layer of ``model`` into its base layer (peft ``LoraLayer.merge``) and put the
    plain base layer back: the state dict has no peft keys afterwards. In place; returns ``model``."""
    from peft.tuners.lora import LoraLayer

    layers = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, LoraLayer)]
    for name, mod in layers:
        mod.merge(safe_merge=True, adapter_names=[ADAPTER])
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, mod.get_base_layer())
    return model
