"""The next token of each row: greedy (argmax, temperature 0) or sampled with temperature and top-p
from the request's own generator (``seed``), on the host for the sampled rows."""
from __future__ import annotations

import torch


def sample_rows(logits_BV: torch.Tensor, requests: list, extra_B: torch.Tensor | None = None):
    """(next token ids for ``requests``, one per row of ``logits_BV``; ``extra_B`` on the host or None):
    one host read of the argmax and ``extra_B`` together, plus each sampled row's logits."""
    B = logits_BV.shape[0]
    parts = [logits_BV.argmax(-1)] + ([extra_B.to(torch.long)] if extra_B is not None else [])
    values = torch.cat(parts).tolist()
    greedy, extra = values[:B], (values[B:] if extra_B is not None else None)
    out = []
    for b, req in enumerate(requests):
        p = req.params
        if p.temperature <= 0:
            out.append(greedy[b])
            continue
        probs_V = torch.softmax(logits_BV[b].float().cpu() / p.temperature, -1)
        if p.top_p < 1.0:
            sorted_V, order_V = probs_V.sort(descending=True)
            keep_V = sorted_V.cumsum(0) - sorted_V < p.top_p  # the smallest prefix reaching top_p
            probs_V = torch.zeros_like(probs_V).scatter(0, order_V[keep_V], sorted_V[keep_V])
        out.append(int(torch.multinomial(probs_V, 1, generator=req.generator)))
    return out, extra
