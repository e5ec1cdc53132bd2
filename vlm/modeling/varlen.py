"""Attention over packed / padded rows without a T x T mask: documents keyed by their boundaries.

A `DocLayout` is built once per forward and per stack (tokens, concepts) from ``valid_BT`` and
``segment_BT`` and handed to every layer in place of the dense mask. A document is every valid
token of one row with one segment id, in row order; every padding token is a document of its own
(it sees only itself). For every valid query that is exactly what the dense reference mask
(``attention.causal_mask``) allows, also for segment ids that are not contiguous in a row; a
padding query there also sees the earlier valid keys of its segment (its output is unused).

Two kernels, chosen per call (``doc_attention``):

* ``flash`` (CUDA, fp16 / bf16, head_dim % 8 == 0 and <= 256): ``torch.nn.attention.varlen
  .varlen_attn`` (FlashAttention-2 varlen, causal via ``window_size=(-1, 0)``, native GQA) over the
  tokens sorted by document, keyed by the cumulative lengths ``cu_seq``. Chosen over FlexAttention:
  no compilation, no block mask to rebuild for every packing, and the layout is already the
  cu_seqlens the kernel wants.
* ``sdpa`` (everything else, e.g. the CPU and fp32 on CUDA): documents bucketed by length (powers
  of two), each bucket gathered into a [n_docs, max_len] batch and run through causal SDPA. Padding
  inside a bucket is < 2x its tokens, so memory is linear in the tokens (no T x T anything) and the
  attention work is at most ~4x the per-document causal work, in at most log2(T) + 1 SDPA calls.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KERNEL = "auto"  # "auto": flash where it applies, else sdpa | "sdpa": always the bucketed SDPA (tests)


@dataclass
class DocLayout:
    """Per-document boundaries of B rows of T positions (flattened row-major, N = B * T)."""
    B: int
    T: int
    perm_N: torch.Tensor  # flat token index of each slot in document order
    inv_N: torch.Tensor  # slot in document order of each flat token
    cu_seq: torch.Tensor  # [num_docs + 1] int32 cumulative document lengths (document order)
    max_len: int
    buckets: list  # (gather_nL flat token ids, keep_K kept positions of the flattened n x L batch)
    order_N: torch.Tensor  # flat token t's output = cat(bucket outputs)[order_N[t]]

    @property
    def num_docs(self) -> int:
        return self.cu_seq.numel() - 1

    @classmethod
    def build(cls, valid_BT: torch.Tensor | None, segment_BT: torch.Tensor | None) -> DocLayout:
        ref = valid_BT if valid_BT is not None else segment_BT
        if ref is None:
            raise ValueError("DocLayout.build needs valid_BT or segment_BT")
        B, T = ref.shape
        N, device = B * T, ref.device
        valid_N = valid_BT.reshape(N).bool() if valid_BT is not None else \
            torch.ones(N, dtype=torch.bool, device=device)
        seg_N = segment_BT.reshape(N) if segment_BT is not None else \
            torch.zeros(N, dtype=torch.long, device=device)
        row_N = torch.arange(N, device=device) // T
        # least significant key first (stable sorts): segment, then valid before padding, then row
        perm = torch.argsort(seg_N, stable=True)
        perm = perm[torch.argsort((~valid_N[perm]).to(torch.int8), stable=True)]
        perm = perm[torch.argsort(row_N[perm], stable=True)]
        r, s, v = row_N[perm], seg_N[perm], valid_N[perm]
        new = ~v  # every padding token starts (and is) its own document
        new[1:] |= (r[1:] != r[:-1]) | (s[1:] != s[:-1]) | ~v[:-1]
        new[0] = True
        starts_D = new.nonzero().squeeze(1)
        cu = torch.cat([starts_D, starts_D.new_full((1,), N)])
        len_D = cu.diff()
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(N, device=device)
        buckets, slots = [], []
        bucket_D = torch.log2(len_D.double()).ceil().long()  # exact for lengths < 2^52
        for b in torch.unique(bucket_D).tolist():
            docs = (bucket_D == b).nonzero().squeeze(1)
            L_n = len_D[docs]
            cap = int(L_n.max())
            t_L = torch.arange(cap, device=device)
            slot_nL = starts_D[docs, None] + t_L
            keep_K = (t_L < L_n[:, None]).reshape(-1).nonzero().squeeze(1)
            # slots past a document's end read any token: only later (causally invisible) positions
            buckets.append((perm[slot_nL.clamp(max=N - 1)], keep_K))
            slots.append(slot_nL.reshape(-1)[keep_K])
        order = torch.empty_like(perm)
        order[perm[torch.cat(slots)]] = torch.arange(N, device=device)
        return cls(B, T, perm, inv, cu.to(torch.int32), int(len_D.max()), buckets, order)


def flash_applies(q_BHTD: torch.Tensor) -> bool:
    D = q_BHTD.shape[-1]
    return (KERNEL == "auto" and q_BHTD.is_cuda and q_BHTD.dtype in (torch.float16, torch.bfloat16)
            and D % 8 == 0 and D <= 256)


def doc_attention(q_BHTD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor,
                  layout: DocLayout) -> torch.Tensor:
    """Causal attention within each document of ``layout``; returns [B, T, H, D]."""
    B, H, T, D = q_BHTD.shape
    if (B, T) != (layout.B, layout.T):
        raise ValueError(f"DocLayout is for {layout.B} x {layout.T} positions, got {B} x {T}")

    def flat(x_BHTD):  # [N, heads, D], row-major tokens
        return x_BHTD.transpose(1, 2).reshape(B * T, x_BHTD.shape[1], D)

    q_NHD, k_NHD, v_NHD = flat(q_BHTD), flat(k_BHTD), flat(v_BHTD)
    if flash_applies(q_BHTD):
        from torch.nn.attention.varlen import varlen_attn
        p = layout.perm_N
        out = varlen_attn(q_NHD[p], k_NHD[p], v_NHD[p], layout.cu_seq, layout.cu_seq, layout.max_len,
                          layout.max_len, window_size=(-1, 0), enable_gqa=True)
        return out[layout.inv_N].view(B, T, H, D)
    outs = []
    for gather_nL, keep_K in layout.buckets:
        n, L = gather_nL.shape
        qb, kb, vb = (x[gather_nL].transpose(1, 2) for x in (q_NHD, k_NHD, v_NHD))  # [n, heads, L, D]
        ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
        outs.append(ob.transpose(1, 2).reshape(n * L, H, D)[keep_K])
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[layout.order_N].view(B, T, H, D)
