"""Attention over packed / padded rows without a T x T mask: documents keyed by their boundaries.

A `DocLayout` is built once per forward and per stack (tokens, concepts) from ``valid_BT`` and
``segment_BT`` and handed to every layer in place of the dense mask. A document is every valid
token of one row with one segment id, in row order; every padding token is a document of its own
(it sees only itself). For every valid query that is exactly what the dense reference mask
(``attention.causal_mask``) allows, also for segment ids that are not contiguous in a row; a
padding query there also sees the earlier valid keys of its segment (its output is unused).

Three kernels, chosen per call (``doc_attention``; its ``kernel`` argument, the model's
``runtime.varlen_kernel``, forces one, or "cuda": the CUDA choice on any device, flash through a
stand-in of ``varlen_attn`` on the CPU: tests/_cuda_on_cpu.py):

* ``flash`` (CUDA, fp16 / bf16, head_dim % 8 == 0 and <= 256): ``torch.nn.attention.varlen
  .varlen_attn`` (FlashAttention-2 varlen, causal, GQA; ``features.varlen_call``) over the
  tokens sorted by document, keyed by the cumulative lengths ``cu_seq``. Chosen over FlexAttention:
  no compilation, no block mask to rebuild for every packing, and the layout is already the
  cu_seqlens the kernel wants.
* ``loop`` (the CPU): causal attention per document on views of the rows, written into one
  output and one gradient buffer (``doc_sdpa.DocSDPA``; one gather first only when the documents
  are not already contiguous: interleaved segment ids); runs of length-1 documents (padding) in
  one step, out = v. Measured on one CPU thread against ``bucketed``
  (forward, 8 heads, head_dim 64): 8 x 2K tokens 569 vs 640 ms, 4K + 300 short documents 314 vs
  404 ms, 2000 documents of 1-31 tokens 163 vs 414 ms: the gathers cost more than the Python loop.
* ``bucketed`` (CUDA without flash, e.g. fp32): documents bucketed by length (powers of two),
  each bucket gathered into a [n_docs, max_len] batch for one causal SDPA: at most log2(T) + 1
  launches whatever the number of documents; padding inside a bucket < 2x its tokens.

Memory is linear in the tokens for all three (no T x T anything). Under ``torch.compile`` (a
compiled block, ``train.compile``) ``loop`` and ``bucketed`` would unroll their Python lists of
documents into the graph, one graph per packing; there ``auto`` runs ``masked`` instead: one SDPA
with a [B, 1, T, T] document mask built on the device from the layout's tensors (no host list, so
any packing of any length reuses the graph; memory quadratic in the row length).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from .doc_sdpa import DocSDPA
from .features import varlen_api, varlen_call
from .syncs import host_sync

LAYOUT_SYNC = ("varlen: the document starts and lengths (cu_seqlens, the longest document and the "
               "length buckets are the attention kernels' shapes); once per stack and forward")
LOOP_SYNC = ("varlen: the loop kernel's document runs (the CPU's kernel; flash on CUDA reads nothing); once per stack "
             "and forward")

KERNELS = ("auto", "loop", "bucketed", "cuda")  # "auto": flash where it applies, else loop on the CPU, else bucketed


@dataclass
class DocLayout:
    """Per-document boundaries of B rows of T positions (flattened row-major, N = B * T)."""
    B: int
    T: int
    perm_N: torch.Tensor | None  # flat token index of each slot in document order (None: identity)
    inv_N: torch.Tensor  # slot in document order of each flat token
    cu_seq: torch.Tensor  # [num_docs + 1] int32 cumulative document lengths (document order)
    max_len: int
    buckets: list | None  # (n, L, flat_K): flat token of each of the n x L slots of a bucket (K = n * L); None: not built
    src_N: torch.Tensor | None  # token t's output = cat(bucket outputs, flattened)[src_N[t]] (None: identity)
    padded: bool | None = None  # whether any position is padding (host-known; None: not known)

    @property
    def num_docs(self) -> int:
        return self.cu_seq.numel() - 1

    def to(self, device: torch.device | str, non_blocking: bool = False) -> DocLayout:
        """This layout with its tensors on ``device``: a layout built on the host (by the collator, from
        the batch it assembled) reaches the GPU as copies, pinned for ``non_blocking``, with no device read.
        Host-side fields (``max_len``, the loop kernel's ``pieces``) travel as computed."""
        device = torch.device(device)
        if self.cu_seq.device == device:
            return self

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if non_blocking and device.type == "cuda" and t.device.type == "cpu":
                t = t.pin_memory()
            return t.to(device, non_blocking=non_blocking)
        buckets = None if self.buckets is None else [(n, L, move(flat)) for n, L, flat in self.buckets]
        out = DocLayout(self.B, self.T, move(self.perm_N), move(self.inv_N), move(self.cu_seq), self.max_len,
                        buckets, move(self.src_N), self.padded)
        if "pieces" in self.__dict__ or self.cu_seq.device.type == "cpu":
            out.__dict__["pieces"] = self.pieces  # computed on the host, where cu_seq is
        return out

    @cached_property
    def pieces(self) -> list[tuple[int, int, bool]]:
        """(start, length, is a run of length-1 documents) in document order, for the loop kernel."""
        with host_sync(LOOP_SYNC):  # CPU only (the loop kernel): nothing waits there
            return self._pieces()

    def _pieces(self) -> list[tuple[int, int, bool]]:
        out: list[tuple[int, int, bool]] = []
        cu = self.cu_seq.tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            if b == a:  # an empty document (concept_layout)
                continue
            if b - a == 1 and out and out[-1][2] and (a - 1) // self.T == a // self.T:
                out[-1] = (out[-1][0], out[-1][1] + 1, True)  # runs stay inside one row
            else:
                out.append((a, b - a, b - a == 1))
        return out

    @classmethod
    @torch.compiler.disable  # host reads (nonzero, unique, lengths): under torch.compile one graph break here
    def build(cls, valid_BT: torch.Tensor | None, segment_BT: torch.Tensor | None,
              reason: str = LAYOUT_SYNC) -> DocLayout:
        """``reason``: the ``host_sync`` its reads run under (another one for tensors already on the host)."""
        with host_sync(reason):
            return cls._build(valid_BT, segment_BT)

    @classmethod
    def on_host(cls, valid_BT: torch.Tensor | None, segment_BT: torch.Tensor | None,
                reason: str = LAYOUT_SYNC) -> DocLayout:
        """``build`` on host tensors with the loop kernel's document runs (``pieces``) computed now too,
        both under ``reason``: the packing collator's layout, the prefill's; the model moves it to the
        device (``to``) and reads nothing in the step."""
        with host_sync(reason):
            layout = cls._build(valid_BT, segment_BT)
            layout.__dict__["pieces"] = layout._pieces()
        return layout

    @classmethod
    def _build(cls, valid_BT: torch.Tensor | None, segment_BT: torch.Tensor | None) -> DocLayout:
        ref = valid_BT if valid_BT is not None else segment_BT
        if ref is None:
            raise ValueError("DocLayout.build needs valid_BT or segment_BT")
        B, T = ref.shape
        N, device = B * T, ref.device
        valid_N = valid_BT.reshape(N).bool() if valid_BT is not None else \
            torch.ones(N, dtype=torch.bool, device=device)
        seg_N = segment_BT.reshape(N) if segment_BT is not None else \
            torch.zeros(N, dtype=torch.long, device=device)
        arange_N = torch.arange(N, device=device)
        row_N = arange_N // T
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
        inv[perm] = arange_N
        buckets, src, offset = [], torch.empty_like(perm), 0
        bucket_D = torch.log2(len_D.double()).ceil().long()  # exact for lengths < 2^52
        for b in torch.unique(bucket_D).tolist():
            docs = (bucket_D == b).nonzero().squeeze(1)
            L_n = len_D[docs]
            n, cap = docs.numel(), int(L_n.max())
            t_L = torch.arange(cap, device=device)
            slot_K = (starts_D[docs, None] + t_L).reshape(-1)
            keep_K = (t_L < L_n[:, None]).reshape(-1)
            # slots past a document's end read any token: only later (causally invisible) positions
            buckets.append((n, cap, perm[slot_K.clamp(max=N - 1)]))
            src[perm[slot_K[keep_K]]] = offset + keep_K.nonzero().squeeze(1)
            offset += n * cap
        # the common packed row (equal documents, no padding) needs no reordering at all
        src = None if offset == N and torch.equal(src, arange_N) else src
        perm = None if torch.equal(perm, arange_N) else perm
        padded = valid_BT is not None and not bool(valid_N.all())
        return cls(B, T, perm, inv, cu.to(torch.int32), int(len_D.max()), buckets, src, padded)


TAIL = 64  # concept_layout: a row's padding slots form documents of at most TAIL slots


def concept_layout(tokens: DocLayout, b_BT: torch.Tensor, tail: int = TAIL) -> DocLayout | None:
    """The concept stack's layout at capacity T (``chunking.form_concepts(capacity=T)``), from the token
    stack's host-built layout and the device's boundaries, with no device read: each token document
    holds the concepts whose boundary token it holds (a padding token: none), in row order, so document
    d of row r starts at concept slot r * T + (boundaries of row r before d); a row's padding slots
    (past its concept count) follow as documents of at most ``tail`` slots. The number of documents
    (token documents + B * ceil(T / tail), empty ones included) and ``max_len`` (the longest token
    document bounds its concepts; ``tail``) are host numbers; the starts are one sort on the device.
    Padding slots see other padding slots of their tail block (their outputs are unused). ``tail``:
    ``TAIL`` for flash (few empty documents in its grid); 1 for the loop kernel, whose document runs
    take a row's length-1 documents in one step (each padding slot its own document, as ``build``).

    None where it does not apply (the caller builds the layout instead): tokens in another order
    than their rows (interleaved segment ids). No length buckets: flash (CUDA) and loop (CPU) only."""
    if tokens.perm_N is not None:
        return None
    B, T = tokens.B, tokens.T
    N, device = B * T, b_BT.device
    cu_D = tokens.cu_seq.to(device, non_blocking=True).long()[:-1]  # token document starts (flat)
    cum_N = F.pad(b_BT.reshape(N).long().cumsum(0), (1, 0))  # boundaries before each flat token
    row_D = cu_D // T
    start_D = row_D * T + cum_N[cu_D] - cum_N[row_D * T]
    count_B = cum_N[T::T] - cum_N[:-1:T]
    k_K = torch.arange(0, T, tail, device=device)
    tail_BK = torch.arange(B, device=device)[:, None] * T + torch.maximum(count_B[:, None], k_K[None])
    starts = torch.sort(torch.cat([start_D, tail_BK.reshape(-1)])).values
    cu = torch.cat([starts, starts.new_full((1,), N)]).to(torch.int32)
    return DocLayout(B, T, None, torch.arange(N, device=device), cu, max(tokens.max_len, min(tail, T)), None, None)


def flash_applies(q_BHTD: torch.Tensor, kernel: str = "auto") -> bool:
    return kernel_for(q_BHTD.device, q_BHTD.dtype, q_BHTD.shape[-1], kernel) == "flash"


def kernel_for(device: torch.device, dtype: torch.dtype, head_dim: int, kernel: str = "auto") -> str:
    """The kernel ``doc_attention`` runs for queries of this device, dtype and head size under the
    choice ``kernel`` (``KERNELS``; "cuda": auto's choice on CUDA, on any device)."""
    cuda = device.type == "cuda" or kernel == "cuda"
    if (kernel in ("auto", "cuda") and cuda and varlen_api() is not None
            and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256):
        return "flash"
    return "loop" if kernel == "loop" or (kernel == "auto" and not cuda) else "bucketed"


def doc_attention(q_BHTD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor,
                  layout: DocLayout, kernel: str = "auto") -> torch.Tensor:
    """Causal attention within each document of ``layout``; returns [B, T, H, D]. ``kernel``: one of
    ``KERNELS`` (the model's ``runtime.varlen_kernel``)."""
    B, H, T, D = q_BHTD.shape
    if (B, T) != (layout.B, layout.T):
        raise ValueError(f"DocLayout is for {layout.B} x {layout.T} positions, got {B} x {T}")
    if kernel not in KERNELS:
        raise ValueError(f"runtime.varlen_kernel={kernel!r}: use one of {KERNELS}")
    if kernel == "loop" and q_BHTD.is_cuda:
        raise ValueError("runtime.varlen_kernel='loop' runs torch's CPU flash kernel: on CUDA use 'auto' or 'bucketed'")
    if flash_applies(q_BHTD, kernel):
        return _flash(q_BHTD, k_BHTD, v_BHTD, layout)
    if kernel in ("auto", "cuda") and torch.compiler.is_compiling():
        return _masked(q_BHTD, k_BHTD, v_BHTD, layout)
    return _loop(q_BHTD, k_BHTD, v_BHTD, layout) if kernel_for(q_BHTD.device, q_BHTD.dtype, D, kernel) == "loop" \
        else _bucketed(q_BHTD, k_BHTD, v_BHTD, layout)


def _flat(x_BHTD: torch.Tensor) -> torch.Tensor:  # [N, heads * D], row-major tokens (a copy)
    B, h, T, D = x_BHTD.shape
    return x_BHTD.transpose(1, 2).reshape(B * T, h * D)


def _flash(q_BHTD, k_BHTD, v_BHTD, layout: DocLayout) -> torch.Tensor:
    B, H, T, D = q_BHTD.shape
    p = layout.perm_N
    q_NHD, k_NHD, v_NHD = (_flat(x).view(B * T, -1, D) for x in (q_BHTD, k_BHTD, v_BHTD))
    if p is not None:
        q_NHD, k_NHD, v_NHD = q_NHD[p], k_NHD[p], v_NHD[p]
    out = varlen_call(q_NHD, k_NHD, v_NHD, layout.cu_seq, layout.max_len)
    return (out if p is None else out[layout.inv_N]).view(B, T, H, D)


def _masked(q_BHTD, k_BHTD, v_BHTD, layout: DocLayout) -> torch.Tensor:
    """One SDPA, a query seeing the earlier keys of its document; documents from the layout's tensors
    (slot s of the document order is in document searchsorted(cu_seq, s)), never read on the host."""
    B, H, T, D = q_BHTD.shape
    slot_N = torch.arange(B * T, device=q_BHTD.device, dtype=layout.cu_seq.dtype)
    doc_BT = torch.searchsorted(layout.cu_seq, slot_N, right=True)[layout.inv_N].view(B, T)
    pos_T = torch.arange(T, device=q_BHTD.device)
    mask_BTT = (doc_BT[:, :, None] == doc_BT[:, None, :]) & (pos_T[None, :] <= pos_T[:, None])[None]
    out_BHTD = F.scaled_dot_product_attention(q_BHTD, k_BHTD, v_BHTD, attn_mask=mask_BTT[:, None], enable_gqa=True)
    return out_BHTD.transpose(1, 2)


def _loop(q_BHTD, k_BHTD, v_BHTD, layout: DocLayout) -> torch.Tensor:
    B, H, T, D = q_BHTD.shape
    if layout.perm_N is None:  # every document is a slice of its row
        return DocSDPA.apply(q_BHTD, k_BHTD, v_BHTD, layout.pieces, T)
    # tokens in document order, as one row: [1, heads, N, D]
    src = tuple(_flat(x).index_select(0, layout.perm_N).view(1, B * T, -1, D).transpose(1, 2)
                for x in (q_BHTD, k_BHTD, v_BHTD))
    out_NHD = DocSDPA.apply(*src, layout.pieces, B * T)[0]
    return out_NHD.index_select(0, layout.inv_N).view(B, T, H, D)


def _bucketed(q_BHTD, k_BHTD, v_BHTD, layout: DocLayout) -> torch.Tensor:
    B, H, T, D = q_BHTD.shape
    if layout.buckets is None:
        raise ValueError("this DocLayout has no length buckets (concept_layout): use DocLayout.build for 'bucketed'")
    # one contiguous copy per tensor, then 1-D row gathers (index_select: fast, and a cheap backward)
    q_NF, k_NF, v_NF = (_flat(x) for x in (q_BHTD, k_BHTD, v_BHTD))
    outs = []
    for n, L, flat_K in layout.buckets:
        qb, kb, vb = (x.index_select(0, flat_K).view(n, L, -1, D).transpose(1, 2) for x in (q_NF, k_NF, v_NF))
        ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)  # [n, H, L, D]
        outs.append(ob.transpose(1, 2).reshape(n * L, H * D))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return (out if layout.src_N is None else out.index_select(0, layout.src_N)).view(B, T, H, D)
