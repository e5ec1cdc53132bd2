"""Safe loading: our checkpoints are safetensors; a pickle is never unpickled unless asked for.

``require_safetensors(folder)`` refuses a local checkpoint folder that holds only pickles
(``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``) unless ``trust_pickle=True``. Every ``from_pretrained``
of our model classes goes through it and passes ``use_safetensors=True`` to transformers.
DeepSpeed's own engine checkpoints (resume) are files our trainer wrote itself: resuming trusts the
run directory (see the README's Reliability section).
"""
from __future__ import annotations

from pathlib import Path

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class UnsafeCheckpoint(ValueError):
    """A checkpoint folder holds weights only as pickles."""


def require_safetensors(folder, trust_pickle: bool = False) -> None:
    path = Path(folder)
    if not path.is_dir():
        return  # not a local folder: transformers reports the missing path itself
    if any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").exists():
        return
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles and not trust_pickle:
        raise UnsafeCheckpoint(f"{path} holds only pickle weights ({', '.join(pickles[:3])}); loading them can run "
                               "code. Convert to safetensors, or pass trust_pickle=True if you trust the file.")
