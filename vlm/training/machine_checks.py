"""Choices this machine or the file system decides, checked by ``python -m vlm.train`` right after the
config and before the model config, the model or DeepSpeed: the model's folders exist, ``device: cuda``
and a fused kernel named by ``train.fused_kernels`` have a CUDA device (and the kernel's package), and
``parallel.expert_parallel_size`` divides the launcher's world size.
Files only, and torch imported only when a GPU's device node is there to be asked about."""
from __future__ import annotations

import glob
import importlib.util
import os
from pathlib import Path

from vlm.modeling.config_base import ConfigError

# what each kernel's fused name needs (vlm/modeling/fused_kernels.py: FUSED, PACKAGE, DIST; that module
# imports torch, so the names are repeated here and a test keeps the two equal)
FUSED = {"cross_entropy": "liger", "rms_norm": "liger", "swiglu": "triton"}
PACKAGE = {"liger": "liger_kernel", "triton": "triton"}
DIST = {"liger": "liger-kernel (pip install -e '.[gpu]')", "triton": "triton"}
FOLDERS = {"tokenizer": "run `make data`?", "llm": "a transformers or ConceptMoE folder",
           "init_from": "run the previous stage first?"}
GPU_NODES = ("/dev/nvidia[0-9]*", "/dev/kfd")  # NVIDIA's device nodes; ROCm's (torch.cuda there too)


def cuda_present() -> bool:
    """Whether torch would see a CUDA device: no device node (or CUDA_VISIBLE_DEVICES empty / -1) is a
    certain no without torch; with one, torch is asked."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    if not any(glob.glob(pattern) for pattern in GPU_NODES):
        return False
    import torch

    return torch.cuda.is_available()


def check_model_folders(cfg) -> None:
    """``model.tokenizer`` / ``model.llm`` / ``model.init_from``: a folder that is not there is one line."""
    for key, hint in FOLDERS.items():
        path = getattr(cfg.model, key)
        if path and not Path(path).is_dir():
            raise ConfigError(f"config error: model.{key}: folder not found: {path} ({hint})")


def check_device_choices(cfg, has_cuda=cuda_present) -> None:
    """``device: cuda`` or a fused kernel named (liger / triton) where they cannot run: one line.
    ``has_cuda`` is called only when one of them is asked for."""
    named = {k: v for k, v in cfg.train.fused_kernels.model_dump().items() if v == FUSED.get(k)}
    if cfg.device == "cpu":
        device = "cpu"
    elif cfg.device == "cuda" or named:
        device = "cuda" if has_cuda() else "cpu"
        if cfg.device == "cuda" and device != "cuda":
            raise ConfigError("config error: device: cuda was asked for but this machine has no CUDA device "
                              "(device: auto trains on the CPU)")
    else:
        return
    for kernel, name in named.items():
        if device != "cuda":
            raise ConfigError(f"config error: train.fused_kernels.{kernel}={name}: the fused kernels run on CUDA, "
                              f"the device is {device} (auto or torch runs here)")
        if importlib.util.find_spec(PACKAGE[name]) is None:
            raise ConfigError(f"config error: train.fused_kernels.{kernel}={name}: {DIST[name]} is not installed")


def check_world_size(cfg, env=os.environ) -> None:
    """``parallel.expert_parallel_size`` must divide the world size the launcher set (WORLD_SIZE; 1 without
    one); what it needs of the model is checked once the model is built (expert_parallel.check_supported)."""
    n, world = cfg.parallel.expert_parallel_size, int(env.get("WORLD_SIZE") or 1)
    if world % n:
        raise ConfigError(f"config error: parallel.expert_parallel_size: {n}: it must divide the world size {world}")


def check_machine(cfg, has_cuda=cuda_present) -> None:
    check_model_folders(cfg)
    check_device_choices(cfg, has_cuda)
    check_world_size(cfg)
