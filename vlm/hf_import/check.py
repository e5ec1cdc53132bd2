"""Logit comparison against the transformers model (fp32, a left-padded batch of 2)."""
from __future__ import annotations

from pathlib import Path

import torch


def reference_model(src: Path):
    """The transformers model of ``src`` in fp32 (safetensors only, no remote code)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32, use_safetensors=True,
                                                trust_remote_code=False).eval()


def left_padded_batch(vocab: int, seq_len: int = 16, pad: int = 5, seed: int = 0):
    """ids, attention mask and positions of a batch of 2; row 1 has ``pad`` left-padding tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, seq_len), generator=g)
    mask = torch.ones(2, seq_len, dtype=torch.long)
    mask[1, :pad] = 0
    pos = (mask.cumsum(1) - 1).clamp(min=0)  # what transformers' generate passes for left padding
    return ids, mask, pos


@torch.no_grad()
def logit_gap(ours, reference, vocab: int, seq_len: int = 16, seed: int = 0) -> float:
    """Largest |logit difference| over the real (non-padding) tokens, both models in fp32."""
    ids, mask, pos = left_padded_batch(vocab, seq_len, seed=seed)
    a = ours.float().eval()(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    b = reference.float().eval()(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    keep = mask.bool()
    return float((a[keep] - b[keep]).abs().max())
