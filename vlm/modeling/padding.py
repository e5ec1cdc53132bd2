"""Padding a batch of prompts: token-id lists -> (input_ids, attention_mask), the layout the processor
and the evaluation's generation and scoring use."""
from __future__ import annotations

import torch


def pad_token_lists(rows, pad_id: int, side: str = "left", device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists -> (input_ids, attention_mask), both Long[B, longest row], padded on ``side``.

    Left padding (the default) is the layout of generation and scoring prompts: every row ends in
    the last column. attention_mask is 1 on real tokens, 0 on padding.
    """
    if side not in ("left", "right"):
        raise ValueError("padding_side must be 'left' or 'right'")
    rows = [list(row) for row in rows]
    width = max((len(row) for row in rows), default=0)
    ids, mask = [], []
    for row in rows:
        fill = width - len(row)
        if side == "left":
            ids.append([pad_id] * fill + row)
            mask.append([0] * fill + [1] * len(row))
        else:
            ids.append(row + [pad_id] * fill)
            mask.append([1] * len(row) + [0] * fill)
    shape = (len(rows), width)
    return (torch.tensor(ids, dtype=torch.long, device=device).view(shape),
            torch.tensor(mask, dtype=torch.long, device=device).view(shape))
