"""Preflight of ``scripts/gpu_check.sh``: what this machine has, and which paths the code takes on it.

    python -m scripts.gpu.environment cuda --out runs/gpu_check/work

Prints (and writes to ``<out>/environment.txt``) the Python, the versions of the packages the check
uses, the device, and the feature-detected paths (``vlm.modeling.features``: one line each,
``<out>/features.txt``). Exit 2 with one line when the device asked for cannot be used or the
project does not import.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import platform
import sys
from pathlib import Path

PACKAGES = ("torch", "transformers", "deepspeed", "pydantic", "timm", "peft", "tokenizers", "safetensors",
            "huggingface-hub", "numpy", "triton", "open-clip-torch", "webdataset")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("device", help="cpu | cuda | cuda:N")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [f"python {platform.python_version()} ({sys.executable})"]
    for name in PACKAGES:
        try:
            lines.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            lines.append(f"{name} (not installed)")
    import torch
    dev = torch.device(args.device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            print(f"error: torch {torch.__version__} (CUDA {torch.version.cuda}): torch.cuda.is_available() is False")
            return 2
        p = torch.cuda.get_device_properties(dev)
        lines.append(f"gpu {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, "
                     f"{p.multi_processor_count} SMs | cuda {torch.version.cuda} | bf16 {torch.cuda.is_bf16_supported()}")
    try:
        from vlm import register_auto_classes
        from vlm.modeling import features

        register_auto_classes()  # imports every model module: fails first on a missing dependency
    except ImportError as err:
        print(f"error: the project does not import here: {err}")
        return 2
    found = features.report(dev)
    (args.out / "environment.txt").write_text("\n".join(lines) + "\n")
    (args.out / "features.txt").write_text("\n".join(found) + "\n")
    print("\n".join(lines))
    print("feature-detected paths:")
    print("\n".join(f"  {line}" for line in found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
