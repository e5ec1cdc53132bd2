"""Light helpers shared by the evaluation CLIs (no torch / lmms-eval imports)."""
from __future__ import annotations

import json
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TASKS_DIR = Path(__file__).resolve().parent / "tasks"
LOCAL_TASK_PREFIX = "cmoe_"
# The lmms-eval model's defaults, make eval's too: batch 8 at 1 CPU thread (this model's matmuls are too small
# for intra-op threads; configs/train/default.yaml): same scores as batch 1 at all cores, 4x to 50x sooner on 2
# cores (idle to busy). lmms-eval's CLI always passes its own --batch_size (1 unless given): pass 8 there.
DEFAULT_BATCH_SIZE = 8
DEFAULT_CPU_THREADS = 1


def checkpoint_problem(path: str, need_processor: bool = True, model_types=("conceptmoe_vlm",)) -> str | None:
    """One line saying why ``path`` is not a usable HF export folder, or None when it looks fine."""
    if not path:
        return "no checkpoint given"
    if not os.path.exists(path):
        return f"checkpoint folder not found: {path}"
    if not os.path.isdir(path):
        return f"checkpoint is not a folder: {path}"
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return f"not a Hugging Face export (no config.json): {path}"
    try:
        with open(config, encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError) as err:
        return f"unreadable config.json in {path}: {err}"
    if model_types and model_type not in model_types:
        return f"{path}: model_type={model_type!r}, expected one of {list(model_types)}"
    names = os.listdir(path)
    if not any(n.endswith((".safetensors", ".safetensors.index.json")) for n in names):
        return f"no model.safetensors in checkpoint folder: {path}"
    if need_processor and "processor_config.json" not in names:
        return f"no processor_config.json in {path} (export the processor with the model)"
    return None

