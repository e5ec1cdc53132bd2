"""``saved_equals_live``: a saved Hugging Face folder holds exactly the live model's tensors (a weight the
save drops would come back re-initialised on load, e.g. the chunk router as identity)."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file


def saved_equals_live(model: torch.nn.Module, folder: Path, tied: tuple = ()) -> None:
    """Every tensor of ``model.state_dict()`` (less the ``tied`` aliases, which transformers saves once) is
    in ``folder/model.safetensors`` and equal there, and nothing else is."""
    saved = load_file(Path(folder) / "model.safetensors")
    live = {k: v.detach().float().cpu() for k, v in model.state_dict().items() if k not in tied}
    assert set(saved) == set(live), sorted(set(saved) ^ set(live))[:8]
    for k, v in saved.items():
        assert torch.equal(v.float(), live[k]), k
