"""FLOPs / parameter / KV-cache accountant for ``ConceptMoEConfig`` (plain MoE and ConceptMoE):
``count_params``, ``flops_per_token`` (its docstring states the counting conventions),
``kv_bytes_per_token``, ``compare_table``; CLI ``python -m vlm.flops --help``."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

SCAN_BLOCK = 64  # vlm.modeling.linear_scan.BLOCK (the chunk of the dechunk EMA scan)
SCAN_MAX_CHUNKS = 512  # vlm.modeling.linear_scan.MAX_CHUNKS


@dataclass(frozen=True)
class Arch:
    """The numbers of a ``ConceptMoEConfig`` that size the model (cheap to copy for solvers)."""
    vocab: int
    d: int
    L: int
    heads: int
    kv: int
    head_dim: int | None
    E: int
    k: int
    inter: int
    shared: int
    first_k_dense: int
    dense_inter: int
    tie: bool
    chunking: bool = False
    L_E: int = 1
    L_D: int = 1
    d_c: int | None = None
    k_c: int | None = None
    loop_layers: tuple = ()
    loop_times: int = 1
    joint: int = 4
    R: float = 2.0

    @classmethod
    def of(cls, cfg) -> Arch:
        if isinstance(cfg, Arch):
            return cfg
        return cls(vocab=cfg.vocab_size, d=cfg.hidden_size, L=cfg.num_hidden_layers,
                   heads=cfg.num_attention_heads, kv=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                   E=cfg.num_experts, k=cfg.top_k, inter=cfg.moe_intermediate_size,
                   shared=cfg.shared_expert_intermediate_size, first_k_dense=cfg.first_k_dense,
                   dense_inter=cfg.dense_intermediate_size, tie=bool(cfg.tie_word_embeddings),
                   chunking=bool(cfg.chunking), L_E=cfg.encoder_layers, L_D=cfg.decoder_layers,
                   d_c=cfg.concept_hidden_size, k_c=cfg.concept_top_k,
                   loop_layers=tuple(cfg.concept_loop_layers), loop_times=cfg.concept_loop_times,
                   joint=cfg.joint_decoding_layers, R=float(cfg.target_ratio))

    def with_(self, **kw) -> Arch:
        return replace(self, **kw)

    # layout, mirroring ConceptMoEModel.__init__ ----------------------------------------------
    @property
    def n_enc(self) -> int:
        return self.L_E if self.chunking else self.L

    @property
    def n_dec(self) -> int:
        return self.L_D if self.chunking else 0

    @property
    def n_con(self) -> int:
        return self.L - self.n_enc - self.n_dec

    @property
    def width_c(self) -> int:
        return self.d_c or self.d

    @property
    def n_joint(self) -> int:
        return min(self.joint, self.n_dec) if self.chunking else 0

    def hd(self, width: int) -> int:
        return self.head_dim or width // self.heads

    def runs(self, j: int) -> int:
        """How often concept layer j runs (``concept_schedule``)."""
        return self.loop_times if j in set(self.loop_layers) else 1

    def layers(self):
        """(kind, width, dense, top_k, joint, runs) per layer; kind in enc/con/dec."""
        out = []
        joint_from = self.L - self.n_joint
        for i in range(self.L):
            con = self.n_enc <= i < self.n_enc + self.n_con
            kind = "con" if con else ("enc" if i < self.n_enc else "dec")
            out.append((kind, self.width_c if con else self.d, i < self.first_k_dense,
                        (self.k_c or self.k) if con else self.k, i >= joint_from,
                        self.runs(i - self.n_enc) if con else 1))
        return out


def _attn_params(a: Arch, w: int) -> int:
    hd = a.hd(w)
    return 2 * w * a.heads * hd + 2 * w * a.kv * hd


def _joint_params(a: Arch) -> int:
    hd = a.hd(a.d)
    return a.d * (a.heads * hd + 2 * a.kv * hd)


def count_params(cfg, ratio: float | None = None) -> dict:
    """Total parameters by part (``total`` == the model's numel) and ``activated`` per token."""
    a = Arch.of(cfg)
    R = _ratio(a, ratio)
    p = dict.fromkeys(("embedding", "lm_head", "norms", "attention", "joint_proj", "router", "experts",
                       "shared_expert", "dense_ffn", "chunker", "concept_proj"), 0)
    act = 0.0
    p["embedding"] = a.vocab * a.d
    p["lm_head"] = 0 if a.tie else a.vocab * a.d
    p["norms"] = a.d
    act += a.vocab * a.d + a.d  # LM head (counted even when tied) + final norm
    for kind, w, dense, k, joint, runs in a.layers():
        scale = runs / R if kind == "con" else 1.0
        layer_act = 0
        p["norms"] += 2 * w
        p["attention"] += _attn_params(a, w)
        layer_act += 2 * w + _attn_params(a, w)
        if joint:
            p["joint_proj"] += _joint_params(a)
            layer_act += _joint_params(a)
        if dense:
            p["dense_ffn"] += 3 * w * a.dense_inter
            layer_act += 3 * w * a.dense_inter
        else:
            p["router"] += w * a.E
            p["experts"] += 3 * a.E * w * a.inter
            p["shared_expert"] += 3 * w * a.shared
            layer_act += w * a.E + 3 * k * w * a.inter + 3 * w * a.shared
        act += scale * layer_act
    if a.chunking:
        p["chunker"] = 2 * a.d * a.d
        act += 2 * a.d * a.d
        if a.width_c != a.d:
            p["concept_proj"] = 2 * a.d * a.width_c
            act += 2 * a.d * a.width_c / R
    p["total"] = sum(p.values())
    p["activated"] = act
    return p


def _ratio(a: Arch, ratio: float | None) -> float:
    if not a.chunking:
        return 1.0
    return float(ratio) if ratio is not None else a.R


def dechunk_flops_per_token(d: int, seq_len: float, ratio: float) -> float:
    """Forward FLOPs per token of the dechunk EMA scan (``linear_scan.scan_torch``): a [Q, Q] x [Q, d] matmul
    per chunk of Q concepts (the last chunk padded) and the [N, N] x [N, d] carry across the N chunks."""
    M = max(1, math.ceil(seq_len / ratio - 1e-9))
    Q = max(SCAN_BLOCK, math.ceil(M / SCAN_MAX_CHUNKS))
    chunks = math.ceil(M / Q)
    return 2 * d * (chunks * Q * Q + chunks * chunks) / seq_len


def flops_per_token(cfg, seq_len: int = 4096, ratio: float | None = None, causal_half: bool = False) -> dict:
    """Forward FLOPs per token by part, plus ``total``, ``total_no_attn_map`` and ``train_*`` (3x).

    ``ratio`` is R = tokens / concepts (default: the config's target ratio); pass the measured one
    (``seq_len / num_concepts``) to account for a real forward pass.

    Conventions (read these before quoting a number):

    - FLOPs are forward FLOPs per token, ``2 * MACs`` of the matmul-like ops only (linear layers,
      expert matmuls, attention QK^T and AV, the blocked EMA scan). Elementwise work (norms, RoPE,
      softmax, SiLU, residual adds, the EMA combine) is not counted anywhere: this is the usual
      model-FLOPs convention and it is what ``torch.utils.flop_counter.FlopCounterMode`` counts.
    - Training FLOPs per token = 3 x forward (backward = 2 x forward) when every part trains; see
      ``train_total``. Frozen parts (no weight gradient): ``vlm.flops.training.train_flops_per_token``.
    - Attention map: the FULL N x N product for causal attention (``4 * N * heads * head_dim`` per
      token and layer), which is what FlopCounterMode's SDPA formula counts on CUDA (it ignores
      ``is_causal``). On CPU FlopCounterMode counts NOTHING for SDPA (torch 2.14 has no formula for
      ``_scaled_dot_product_flash_attention_for_cpu``); the tests register that formula explicitly.
      ``causal_half=True`` counts the causal half instead. Concept layers attend over M = N / R
      concepts, so their map costs ``4 * N * heads * head_dim_c / R^2`` per token and run.
    - Per-token numbers of the concept model are per concept divided by R (one concept per R tokens);
      looped layers count once per run (``concept_schedule``).
    - Activated params per token: everything a token touches except the embedding lookup (the LM head
      is counted even when tied); experts: top_k (+ shared); concept layers weighted by runs / R.
    - KV bytes per token: token layers 2 * kv_heads * head_dim * dtype_bytes each; concept layers
      the same per concept (i.e. / R per token), once per run (each loop slot has its own cache).
      With ``concept_merge="sum"`` the cache holds completed concepts only (one entry fewer per row).
    - The chunker projects every token (W_q, W_k: 4 d^2 FLOPs); the dechunk is the chunked EMA scan of
      ``linear_scan.scan_torch``: a [Q, Q] x [Q, d] matmul per chunk of Q = 64 concepts (the last chunk
      padded) and the [N, N] x [N, d] carry across the N chunks.

    API: ``count_params``, ``flops_per_token``, ``kv_bytes_per_token``, ``compare_table``; the matching
    solver is ``vlm.flops.matching``; CLI ``python -m vlm.flops --help``.
    """
    a = Arch.of(cfg)
    R = _ratio(a, ratio)
    N = float(seq_len)
    f = dict.fromkeys(("attn_proj", "joint_proj", "attn_map", "moe_ffn", "dense_ffn", "chunk", "dechunk",
                       "concept_proj", "lm_head"), 0.0)
    map_factor = 0.5 if causal_half else 1.0
    for kind, w, dense, k, joint, runs in a.layers():
        hd = a.hd(w)
        if kind == "con":
            scale, ctx = runs / R, N / R
        else:
            scale, ctx = 1.0, N
        f["attn_proj"] += scale * 2 * _attn_params(a, w)
        f["attn_map"] += scale * map_factor * 4 * ctx * a.heads * hd
        if joint:
            f["joint_proj"] += 2 * _joint_params(a)
        if dense:
            f["dense_ffn"] += scale * 6 * w * a.dense_inter
        else:
            f["moe_ffn"] += scale * (2 * w * a.E + 6 * k * w * a.inter + 6 * w * a.shared)
    f["lm_head"] = 2 * a.d * a.vocab
    if a.chunking:
        f["chunk"] = 4 * a.d * a.d
        f["dechunk"] = dechunk_flops_per_token(a.d, N, R)
        if a.width_c != a.d:
            f["concept_proj"] = 4 * a.d * a.width_c / R
    f["total"] = sum(f.values())
    f["total_no_attn_map"] = f["total"] - f["attn_map"]
    f["train_total"] = 3 * f["total"]
    f["train_total_no_attn_map"] = 3 * f["total_no_attn_map"]
    return f


def kv_bytes_per_token(cfg, ratio: float | None = None, dtype_bytes: int = 2) -> dict:
    """KV-cache bytes per token of context: encoder, concept (per concept / R, per run), decoder.

    A plain MoE (chunking off) has all its layers under ``encoder`` (the model's own layout)."""
    a = Arch.of(cfg)
    R = _ratio(a, ratio)
    out = {"encoder": 0.0, "concept": 0.0, "decoder": 0.0}
    for kind, w, _, _, _, runs in a.layers():
        per_entry = 2 * a.kv * a.hd(w) * dtype_bytes
        if kind == "con":
            out["concept"] += runs * per_entry / R
        else:
            out["encoder" if kind == "enc" else "decoder"] += per_entry
    out["total"] = out["encoder"] + out["concept"] + out["decoder"]
    return out


# tables ---------------------------------------------------------------------------------------
def _fmt(x: float, unit: str = "") -> str:
    for div, suf in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.4g}{suf}{unit}"
    return f"{x:.4g}{unit}"


def describe(cfg) -> str:
    a = Arch.of(cfg)
    if not a.chunking:
        return f"plain MoE: L={a.L}, d={a.d}, E={a.E}, top-{a.k}, expert {a.inter}"
    loop = f", loop {list(a.loop_layers)}x{a.loop_times}" if a.loop_layers and a.loop_times > 1 else ""
    return (f"ConceptMoE R={a.R:g}: L_E/L_C/L_D={a.n_enc}/{a.n_con}/{a.n_dec}, d={a.d}, d_c={a.width_c}, "
            f"E={a.E}, top-{a.k} (concept top-{a.k_c or a.k}){loop}, joint K={a.n_joint}")


def summary(cfg, seq_len: int = 4096, ratio: float | None = None, dtype_bytes: int = 2) -> dict:
    """The numbers ``compare_table`` shows."""
    a = Arch.of(cfg)
    p, f = count_params(a, ratio), flops_per_token(a, seq_len, ratio)
    return {"total params": p["total"], "activated params/token": p["activated"],
            "activated FLOPs/token (no attn map)": f["total_no_attn_map"],
            f"attn-map FLOPs/token @{seq_len}": f["attn_map"],
            "FLOPs/token total (fwd)": f["total"], "train FLOPs/token (3x fwd)": f["train_total"],
            f"KV bytes/token ({dtype_bytes}B)": kv_bytes_per_token(a, ratio, dtype_bytes)["total"]}


def compare_table(cfg_a, cfg_b, seq_len: int = 4096, ratio: float | None = None, dtype_bytes: int = 2,
                  names: tuple = ("A", "B")) -> str:
    """Markdown side-by-side table; ``ratio`` applies to whichever model chunks; diff = B/A - 1."""
    sa = summary(cfg_a, seq_len, ratio, dtype_bytes)
    sb = summary(cfg_b, seq_len, ratio, dtype_bytes)
    lines = [f"| | {names[0]} | {names[1]} | rel. diff |", "|---|---:|---:|---:|"]
    for key in sa:
        diff = sb[key] / sa[key] - 1 if sa[key] else float("nan")
        lines.append(f"| {key} | {_fmt(sa[key])} | {_fmt(sb[key])} | {diff:+.2%} |")
    lines.append(f"\n{names[0]}: {describe(cfg_a)}\n{names[1]}: {describe(cfg_b)}")
    return "\n".join(lines)


def single_table(cfg, seq_len: int = 4096, ratio: float | None = None, dtype_bytes: int = 2) -> str:
    a = Arch.of(cfg)
    p, f = count_params(a, ratio), flops_per_token(a, seq_len, ratio)
    kv = kv_bytes_per_token(a, ratio, dtype_bytes)
    R = _ratio(a, ratio)
    lines = [describe(a), (f"(R used: {R:g}; seq len {seq_len}; forward FLOPs = 2*MACs of matmuls; "
             "attention map = full N x N)"), "", "| parameters | count |", "|---|---:|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in p.items() if v or k in ("total", "activated")]
    lines += ["", "| FLOPs / token | forward | share |", "|---|---:|---:|"]
    lines += [f"| {k} | {_fmt(v)} | {v / f['total']:.1%} |" for k, v in f.items()
              if (v or k.startswith("total")) and not k.startswith("train")]
    lines.append(f"| train (3x forward) | {_fmt(f['train_total'])} | |")
    lines += ["", f"| KV cache bytes / token ({dtype_bytes} B) | bytes |", "|---|---:|"]
    lines += [f"| {k if a.chunking or k == 'total' else 'token layers'} | {v:.1f} |" for k, v in kv.items()
              if v or k == "total"]
    return "\n".join(lines)
