"""Attention: RoPE, grouped-query attention on SDPA, masks, and the KV cache it reads and writes.

One `Attention` class serves every stack. Token layers and concept layers differ only in what
positions they are given (token positions vs concept indices) and in how their cache advances:
token caches advance every step for every row; concept caches advance per row, only when that row
starts a new concept (`KVCache.step(..., commit_B)`), so they hold one entry per concept.

Packed or padded rows (segment ids, padding) get a `DocLayout` (varlen.py): attention per document
keyed by its boundaries, no T x T mask. The dense [B, 1, T, T] mask (`causal_mask`) is the
reference, used everywhere when the model's ``runtime.attention`` is ``"dense"`` (tests compare the two).

Joint decoding (paper section 6) is the optional ``concept_BTD`` input: when the layer was built
with ``joint=True``, Q/K/V each get an extra zero-initialisable projection of the concept signal.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .configuration_conceptmoe import AttentionConfig
from .varlen import DocLayout, doc_attention

from .fused_kernels import rms_norm  # torch path: rms_norm.rms_norm (train.fused_kernels.rms_norm)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # fp32 math; keeps one [.., D] tensor less for the backward


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None, device=None):
    """RoPE inverse frequencies [head_dim / 2] and the cos/sin scale; ``scaling`` (imported checkpoints)
    is transformers' ``rope_parameters`` of type ``linear``, ``llama3`` or ``yarn``, computed as
    transformers' ``modeling_rope_utils`` does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if not scaling:
        return inv_freq, 1.0
    kind, factor = scaling["rope_type"], scaling.get("factor")
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        old_len = scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling)
    raise ValueError(f"rope_scaling_params.rope_type={kind!r} is not supported")


def _yarn(inv_freq, dim: int, base: float, sc: dict):
    factor, orig = sc["factor"], sc["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = sc.get("attention_factor")
    if attention_factor is None:
        m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = sc.get("beta_fast") or 32, sc.get("beta_slow") or 1

    def corr_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if sc.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - lo) / (hi - lo)).clamp(0, 1)
    extra = 1 - ramp
    return inv_freq / factor * (1 - extra) + inv_freq * extra, attention_factor


def rope_cos_sin(position_ids_BT: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 scaling: dict | None = None):
    """RoPE tables [B, T, head_dim] for integer positions (any per-row layout): cos, and sin with the
    rotate-half sign folded in (-sin on the first half, +sin on the second; see ``apply_rope``), built
    once per stack and forward instead of a negation per layer."""
    inv_freq, scale = rope_inv_freq(head_dim, theta, scaling, position_ids_BT.device)
    ang_BTH = position_ids_BT.float()[..., None] * inv_freq
    cos_BTD = torch.cat([ang_BTH, ang_BTH], dim=-1).cos()
    sin_BTH = ang_BTH.sin()
    sin_BTD = torch.cat([-sin_BTH, sin_BTH], dim=-1)
    if scale == 1.0:
        return cos_BTD.to(dtype), sin_BTD.to(dtype)
    return (cos_BTD * scale).to(dtype), (sin_BTD * scale).to(dtype)


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x2, x1], dim=-1)


def apply_rope(x_BHTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    """``x cos + rotate_half(x) sin`` with ``rotate_half(x) = [-x2, x1]``; ``sin_BTD`` comes from
    ``rope_cos_sin`` with the sign already on its first half, so the rotation is a plain half swap
    (the same figures: a negation is exact)."""
    cos, sin = cos_BTD[:, None], sin_BTD[:, None]
    return x_BHTD * cos + _swap_halves(x_BHTD) * sin


def apply_rope_tokens(x_BTHD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` on token-major heads [B, T, heads, D]: the attention rotates q and k in one go."""
    cos, sin = cos_BTD[:, :, None], sin_BTD[:, :, None]
    return x_BTHD * cos + _swap_halves(x_BTHD) * sin


def causal_mask(valid_BT: torch.Tensor | None, segment_BT: torch.Tensor | None, T: int,
                device: torch.device) -> torch.Tensor | None:
    """Boolean SDPA mask [B, 1, T, T] (True = may attend), or None for the plain causal case.

    Keys must be valid (not padding) and in the same packed segment. Every query may always see
    itself, so fully padded rows stay finite instead of producing NaN.
    """
    if valid_BT is None and segment_BT is None:
        return None
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    mask = causal_TT[None]
    if valid_BT is not None:
        mask = mask & valid_BT[:, None, :].bool()
    if segment_BT is not None:
        mask = mask & (segment_BT[:, :, None] == segment_BT[:, None, :])
    mask = mask | torch.eye(T, dtype=torch.bool, device=device)[None]
    return mask[:, None]


def attention_mask(valid_BT: torch.Tensor | None, segment_BT: torch.Tensor | None, T: int,
                   device: torch.device, layout: DocLayout | None = None, impl: str = "varlen"):
    """What every layer of a stack gets as ``mask``: None (plain causal: no padding, no packing), a
    `DocLayout` (``impl`` "varlen") or, with ``impl`` "dense", the reference mask of `causal_mask`. ``layout``:
    the same DocLayout built on the host from these ``valid_BT`` / ``segment_BT`` (the collator's
    ``doc_layout``), moved to ``device`` instead of built there (no device read)."""
    if valid_BT is None and segment_BT is None:
        return None
    if impl == "dense":
        return causal_mask(valid_BT, segment_BT, T, device)
    if impl != "varlen":
        raise ValueError(f"runtime.attention={impl!r}: use 'varlen' or 'dense'")
    if layout is not None:
        B = (valid_BT if valid_BT is not None else segment_BT).shape[0]
        if (layout.B, layout.T) != (B, T):
            raise ValueError(f"doc_layout is for {layout.B} x {layout.T} positions, the batch has {B} x {T}")
        return layout.to(device, non_blocking=True)
    return DocLayout.build(valid_BT, segment_BT)


class KVCache:
    """Preallocated cache of one attention layer: k/v [B, H_kv, capacity, D], per-row lengths.

    ``valid_BC`` marks which slots hold real keys (left padding in token layers stays False).
    ``len_B`` (device) is each row's next write slot; ``size`` (host) an upper bound of its maximum,
    known without reading the device: every step writes at most one entry per row, so the bound is
    the prefill's length plus the steps. A step attends slots [0, size + 1), with ``valid_BC``
    masking the slots a shorter row has not written. Token caches advance every row together
    (``ragged`` False): every row writes at the same host-known slot and ``size`` is exact. Concept
    caches advance per row (``advance(commit_B)``): the bound grows by one per step unless the caller
    knows the exact maximum (``advance(..., size=)``: the decode step's boundary read).

    ``static`` (host; the fixed-shape step of decode_graph.py): every row writes at its ``len_B`` and a
    step attends all ``capacity`` slots with the ``valid_BC`` mask, as transformers' ``StaticCache``
    does, so no shape and no host value changes from one token to the next (a captured graph replays
    it); ``step`` and ``advance`` then leave ``size`` to the caller, outside the captured step.
    """

    def __init__(self, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype):
        self.k = torch.zeros(batch, kv_heads, capacity, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.valid_BC = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.len_B = torch.zeros(batch, dtype=torch.long, device=device)
        self.size = 0  # host: >= every row's len_B (exact when not ragged)
        self.ragged = False  # host: rows may hold different lengths
        self.dense = False  # host: every slot below ``size`` is valid (no left padding): no key mask
        self.static = False  # host: fixed shapes (see the class docstring)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def fill(self, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor, valid_BT: torch.Tensor | None,
             len_B: torch.Tensor | int) -> None:
        """Prefill: slots [0, T) take the given keys. ``len_B``: the next write slot, an int when
        every row continues at the same slot (token caches), else per row (at most T).
        ``valid_BT`` None: every slot is real (no padding)."""
        B, _, T, _ = k_BHTD.shape
        if T > self.capacity:
            raise ValueError(f"KV cache capacity {self.capacity} < prefill length {T}")
        self.k[:, :, :T] = k_BHTD
        self.v[:, :, :T] = v_BHTD
        self.ragged = torch.is_tensor(len_B)
        self.dense = valid_BT is None and not self.ragged
        self.valid_BC[:, :T] = True if valid_BT is None else valid_BT.bool()
        if self.ragged:
            self.len_B, self.size = len_B.clone(), T
        else:
            self.len_B, self.size = torch.full((B,), len_B, dtype=torch.long, device=self.k.device), int(len_B)

    def step(self, k_BH1D: torch.Tensor, v_BH1D: torch.Tensor):
        """Write one new entry per row at ``len_B``; returns keys, values and the key mask [B, S]
        (None: all valid) over the S = size + 1 slots any row may hold (``static``: all capacity slots,
        S = capacity, the caller having checked the room). No device read."""
        if self.static:
            rows = torch.arange(self.k.shape[0], device=self.k.device)
            self.k[rows, :, self.len_B] = k_BH1D[:, :, 0]
            self.v[rows, :, self.len_B] = v_BH1D[:, :, 0]
            self.valid_BC[rows, self.len_B] = True
            return self.k, self.v, self.valid_BC
        s = self.size
        if s >= self.capacity:
            raise ValueError(f"KV cache full (capacity {self.capacity})")
        if self.ragged:
            rows = torch.arange(self.k.shape[0], device=self.k.device)
            self.k[rows, :, self.len_B] = k_BH1D[:, :, 0]
            self.v[rows, :, self.len_B] = v_BH1D[:, :, 0]
            self.valid_BC[rows, self.len_B] = True
        else:  # every row at slot s
            self.k[:, :, s] = k_BH1D[:, :, 0]
            self.v[:, :, s] = v_BH1D[:, :, 0]
            self.valid_BC[:, s] = True
        valid = None if self.dense else self.valid_BC[:, :s + 1]
        return self.k[:, :, :s + 1], self.v[:, :, :s + 1], valid

    def advance(self, commit_B: torch.Tensor | None = None, size: int | None = None) -> None:
        """Keep the entry written by the last ``step`` for rows in ``commit_B`` (all rows if None).
        ``size``: the exact longest row after this advance, when the host knows it (else the bound
        grows by one; ``static``: the caller updates ``size``)."""
        if not self.static:
            self.size = self.size + 1 if size is None else int(size)
        if commit_B is None:
            self.len_B += 1
            return
        if not self.static:
            self.ragged, self.dense = True, False
        rows = torch.arange(self.k.shape[0], device=self.k.device)
        self.valid_BC[rows, self.len_B] = commit_B.bool()
        self.len_B += commit_B.long()

    def num_entries(self) -> torch.Tensor:
        """Real (valid) entries per row."""
        return self.valid_BC.sum(-1)

    def nbytes(self) -> int:
        """Bytes of the keys and values actually held (valid entries of every row)."""
        per_entry = self.k.shape[1] * self.k.shape[3] * self.k.element_size() * 2
        return int(self.num_entries().sum()) * per_entry


class Attention(nn.Module):
    model_config = None  # the ConceptMoEConfig whose ``runtime`` it reads (set by ConceptMoEModel); None: defaults

    def __init__(self, cfg: AttentionConfig, hidden_size: int, joint: bool = False):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim or hidden_size // cfg.num_attention_heads
        qkv_bias = getattr(cfg, "qkv_bias", False)
        self.q_proj = nn.Linear(hidden_size, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, self.n_kv * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, self.n_kv * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden_size, bias=getattr(cfg, "o_proj_bias", False))
        # QK-norm (imported families): "head" = RMSNorm over each head's dim (Qwen3), "full" = over
        # the whole q / k projection before the head split (OLMoE); both before RoPE
        self.qk_norm = getattr(cfg, "qk_norm", "none")
        if self.qk_norm != "none":
            q_dim, k_dim = (self.head_dim, self.head_dim) if self.qk_norm == "head" else \
                (self.n_heads * self.head_dim, self.n_kv * self.head_dim)
            self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps)
        self.joint = joint
        if joint:  # joint decoding: Q = zWq + cWq^c, K = zWk + cWk^c, V = zWv + cWv^c
            self.q_c_proj = nn.Linear(hidden_size, self.n_heads * self.head_dim, bias=False)
            self.k_c_proj = nn.Linear(hidden_size, self.n_kv * self.head_dim, bias=False)
            self.v_c_proj = nn.Linear(hidden_size, self.n_kv * self.head_dim, bias=False)

    @property
    def varlen_kernel(self) -> str:
        """The document-attention kernel choice of the model's ``runtime.varlen_kernel`` (varlen.py)."""
        return "auto" if self.model_config is None else self.model_config.runtime.varlen_kernel

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, heads, self.head_dim).transpose(1, 2)

    def forward(self, x_BTD: torch.Tensor, cos_sin, mask=None, cache: KVCache | None = None,
                concept_BTD: torch.Tensor | None = None, fill=None) -> torch.Tensor:
        """No cache: full causal attention. ``cache`` + ``fill=(valid_BT, len_B)``: full attention
        over the prompt, then the cache is filled. ``cache`` alone: one decoding step (T = 1).
        ``mask``: None (causal), a `DocLayout` (per document) or a dense [B, 1, T, T] bool mask."""
        q, k, v = self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)
        if self.joint and concept_BTD is not None:
            q = q + self.q_c_proj(concept_BTD)
            k = k + self.k_c_proj(concept_BTD)
            v = v + self.v_c_proj(concept_BTD)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        B, T, _ = x_BTD.shape
        q_BTHD, k_BTHD = q.view(B, T, self.n_heads, self.head_dim), k.view(B, T, self.n_kv, self.head_dim)
        if self.qk_norm == "head":
            q_BTHD, k_BTHD = self.q_norm(q_BTHD), self.k_norm(k_BTHD)
        # q and k rotated together (one rotation forward and backward instead of two): token-major
        # [B, T, H + H_kv, D], then split back into views
        cos, sin = cos_sin
        qk_BTHD = apply_rope_tokens(torch.cat([q_BTHD, k_BTHD], 2), cos, sin)
        q_BTHD, k_BTHD = qk_BTHD.split([self.n_heads, self.n_kv], 2)
        q, k, v = q_BTHD.transpose(1, 2), k_BTHD.transpose(1, 2), self._split(v, self.n_kv)
        if cache is not None and fill is None:
            k_all, v_all, valid_BS = cache.step(k, v)
            mask_B11S = None if valid_BS is None else valid_BS[:, None, None, :]
            out_BTHD = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask_B11S,
                                                      enable_gqa=True).transpose(1, 2)
        else:
            if isinstance(mask, DocLayout):
                out_BTHD = doc_attention(q, k, v, mask, self.varlen_kernel)
            else:  # None: plain causal; else the dense [B, 1, T, T] mask
                out_BTHD = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                          enable_gqa=True).transpose(1, 2)
            if cache is not None:
                cache.fill(k, v, *fill)
        B, T = out_BTHD.shape[:2]
        return self.o_proj(out_BTHD.reshape(B, T, self.n_heads * self.head_dim))
