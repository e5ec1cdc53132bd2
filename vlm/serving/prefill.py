"""Prefill of several admitted requests at once: their prompts left-padded to the longest (padding
masked out, as ``generate`` pads a batch), image features spliced in row order. Groups are formed so
that every row's padded prompt + ``max_tokens`` fits the engine's token capacity."""
from __future__ import annotations

import torch


def groups(reqs: list, capacity: int, max_group: int) -> list[list]:
    """``reqs`` in order, cut where a row would no longer fit: padded length + largest max_tokens <= capacity."""
    out, cur = [], []
    for r in reqs:
        cand = [*cur, r]
        need = max(x.prompt_len for x in cand) + max(x.params.max_tokens for x in cand)
        if cur and (need > capacity or len(cur) >= max_group):
            out.append(cur)
            cand = [r]
        cur = cand
    return [*out, cur] if cur else out


@torch.no_grad()
def prefill(model, lm, reqs: list, capacity: int, pad_id: int):
    """(DecodeState with one row per request, next-token logits [B, V]); sets each request's ``pad``."""
    device = next(lm.parameters()).device
    T = max(r.prompt_len for r in reqs)
    ids_BT = torch.full((len(reqs), T), pad_id, dtype=torch.long)
    mask_BT = torch.zeros(len(reqs), T, dtype=torch.long)
    for b, r in enumerate(reqs):
        r.pad = T - r.prompt_len
        ids_BT[b, r.pad:] = r.input_ids[0]
        mask_BT[b, r.pad:] = 1
    ids_BT, mask_BT = ids_BT.to(device), mask_BT.to(device)
    am = None if all(r.pad == 0 for r in reqs) else mask_BT
    state = lm.start_decoding(len(reqs), capacity)
    if hasattr(model, "embed"):  # a VLM: image features spliced into the prompts' embeddings, row by row
        pix = [r.pixel_values for r in reqs if r.pixel_values is not None]
        embeds, modality = model.embed(ids_BT, torch.cat(pix).to(device) if pix else None)
        return state, lm.prefill(state, inputs_embeds=embeds, attention_mask=am, modality_ids=modality)
    return state, lm.prefill(state, input_ids=ids_BT, attention_mask=am)
