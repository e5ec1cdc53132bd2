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
    perm_N: torch.Tensor | None  # flat token index of each slot in document order (None: identity)
    inv_N: torch.Tensor  # slot in document order of each flat token
    cu_seq: torch.Tensor  # [num_docs + 1] int32 cumulative document lengths (document order)
    max_len: int
    buckets: list  # (row_nL, t_nL of each slot's token, keep_K kept positions of n x L or None: all)
    order_N: torch.Tensor | None  # flat token t's output = cat(bucket outputs)[order_N[t]] (None: identity)

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
            slots.append(slot_nL.reshape(-1)[keep_K])
            # slots past a document's end read any token: only later (causally invisible) positions
            full = keep_K.numel() == slot_nL.numel()
            flat_nL = perm[slot_nL.clamp(max=N - 1)]
            buckets.append((flat_nL // T, flat_nL % T, None if full else keep_K))
        order = torch.empty_like(perm)
        arange_N = torch.arange(N, device=device)
        order[perm[torch.cat(slots)]] = arange_N
        # the common packed row (equal documents, no padding) needs none of the reorderings
        order = None if torch.equal(order, arange_N) else order
        perm = None if torch.equal(perm, arange_N) else perm
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

    if flash_applies(q_BHTD):
        from torch.nn.attention.varlen import varlen_attn
        q_NHD, k_NHD, v_NHD = (x.transpose(1, 2).reshape(B * T, x.shape[1], D)
                               for x in (q_BHTD, k_BHTD, v_BHTD))
        p = layout.perm_N
        if p is not None:
            q_NHD, k_NHD, v_NHD = q_NHD[p], k_NHD[p], v_NHD[p]
        out = varlen_attn(q_NHD, k_NHD, v_NHD, layout.cu_seq, layout.cu_seq, layout.max_len,
                          layout.max_len, window_size=(-1, 0), enable_gqa=True)
        return (out if p is None else out[layout.inv_N]).view(B, T, H, D)
    outs = []
    for row_nL, t_nL, keep_K in layout.buckets:
        n, L = row_nL.shape
        # one gather per tensor straight from [B, T, heads, D] views: [n, L, heads, D] -> [n, heads, L, D]
        qb, kb, vb = (x.transpose(1, 2)[row_nL, t_nL].transpose(1, 2) for x in (q_BHTD, k_BHTD, v_BHTD))
        ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
        ob = ob.transpose(1, 2).reshape(n * L, H, D)
        outs.append(ob if keep_K is None else ob[keep_K])
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return (out if layout.order_N is None else out[layout.order_N]).view(B, T, H, D)
