"""Transformers config -> ``ConceptMoEConfig`` (chunking off, vocabulary unchanged), per family.

Every feature that changes the math is carried over exactly or refused with one line naming the
field (``ValueError``). Carried over: GQA / head_dim, RoPE theta, RMSNorm eps, tied embeddings,
attention bias (q/k/v and o separately), rope scaling (linear, llama3, yarn), QK-norm (per head: Qwen3 / Qwen3-MoE; whole projection:
OLMoE), router softmax -> top-k -> optional renormalisation (``norm_topk_prob``; Mixtral always
renormalises), the shared expert and its sigmoid gate (Qwen2-MoE), dense layers
(``decoder_sparse_step`` / ``mlp_only_layers``) when they are the first k layers.

Dense families (Llama, Mistral, Qwen2, Qwen3) become ``first_k_dense = num_hidden_layers`` with
``dense_intermediate_size = intermediate_size``: our dense FFN is ``SwiGLU`` (``vlm/modeling/moe.py``),
``down(silu(gate(x)) * up(x))`` without bias, exactly Llama's MLP with ``hidden_act: silu``.
"""
from __future__ import annotations

from vlm.modeling.configuration_conceptmoe import ConceptMoEConfig

DENSE = ("llama", "mistral", "qwen2", "qwen3")
MOE = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe")
FAMILIES = DENSE + MOE


def _refuse(field: str, value, why: str):
    raise ValueError(f"{field}={value!r}: {why}")


_ROPE_SCALING = {"linear": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                 "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                          "mscale", "mscale_all_dim", "truncate")}


def _rope(c) -> tuple[float, dict | None]:
    """rope_theta and the rope scaling (``attention.rope_scaling_params``: linear, llama3, yarn; others refused)."""
    rp = getattr(c, "rope_parameters", None) or {}
    if "full_attention" in rp and isinstance(rp["full_attention"], dict):
        rp = rp["full_attention"]
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type != "default" and rope_type not in _ROPE_SCALING:
        _refuse("rope_parameters.rope_type", rope_type,
                f"only default, {', '.join(_ROPE_SCALING)} RoPE are supported (dynamic ones are not)")
    if rp.get("partial_rotary_factor", 1.0) != 1.0:
        _refuse("partial_rotary_factor", rp["partial_rotary_factor"], "only full rotary embeddings are supported")
    theta = rp.get("rope_theta", getattr(c, "rope_theta", None))
    if theta is None:
        _refuse("rope_parameters.rope_theta", None, "missing")
    if rope_type == "default":
        return float(theta), None
    if rope_type == "yarn" and rp.get("factor") is None:
        _refuse("rope_parameters.factor", None, "yarn needs an explicit factor")
    scaling = {"rope_type": rope_type, **{k: rp[k] for k in _ROPE_SCALING[rope_type] if rp.get(k) is not None}}
    return float(theta), scaling


def _no_sliding_window(family: str, c) -> None:
    if getattr(c, "use_sliding_window", False):
        _refuse("use_sliding_window", True, "sliding-window attention is not supported")
    types = getattr(c, "layer_types", None)
    if types and any(t != "full_attention" for t in types):
        _refuse("layer_types", sorted(set(types)), "sliding-window attention is not supported")
    if family in ("llama", "mistral", "mixtral", "qwen3_moe", "olmoe") and getattr(c, "sliding_window", None) is not None:
        _refuse("sliding_window", c.sliding_window, "sliding-window attention is not supported")


def _dense_prefix(c, num_experts: int) -> int:
    """Qwen-MoE layer layout -> ``first_k_dense``; refused unless the dense layers are the first k."""
    L = c.num_hidden_layers
    only, step = list(getattr(c, "mlp_only_layers", None) or []), getattr(c, "decoder_sparse_step", 1) or 1
    dense = [i for i in range(L) if not (i not in only and num_experts > 0 and (i + 1) % step == 0)]
    if dense != list(range(len(dense))):
        field = "mlp_only_layers" if only else "decoder_sparse_step"
        _refuse(field, only if only else step, f"dense layers {dense} are not the first k layers "
                "(only moe.first_k_dense is supported)")
    return len(dense)


def _attention_fields(family: str, c) -> dict:
    bias = bool(getattr(c, "attention_bias", False))
    if family == "qwen2":
        qkv, o = True, False
    elif family == "qwen2_moe":
        qkv, o = bool(getattr(c, "qkv_bias", True)), False
    elif family == "mixtral":
        qkv, o = False, False
    else:
        qkv, o = bias, bias
    qk_norm = {"qwen3": "head", "qwen3_moe": "head", "olmoe": "full"}.get(family, "none")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    theta, scaling = _rope(c)
    if family == "olmoe" and c.num_attention_heads * head_dim != c.hidden_size:
        _refuse("head_dim", head_dim, "OLMoE's q_norm spans hidden_size: needs num_attention_heads * head_dim == hidden_size")
    return dict(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                num_key_value_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                head_dim=head_dim, rope_theta=theta, rope_scaling_params=scaling,
                max_position_embeddings=c.max_position_embeddings,
                rms_norm_eps=float(c.rms_norm_eps), qkv_bias=qkv, o_proj_bias=o, qk_norm=qk_norm)


def _moe_fields(family: str, c) -> dict:
    if family in DENSE:
        return dict(first_k_dense=c.num_hidden_layers, dense_intermediate_size=c.intermediate_size)
    if family == "mixtral":
        return dict(num_experts=c.num_local_experts, top_k=c.num_experts_per_tok,
                    moe_intermediate_size=c.intermediate_size, norm_topk_prob=True)
    if family == "olmoe":
        return dict(num_experts=c.num_experts, top_k=c.num_experts_per_tok, moe_intermediate_size=c.intermediate_size,
                    norm_topk_prob=bool(c.norm_topk_prob))
    n_exp = c.num_experts
    k = _dense_prefix(c, n_exp)
    out = dict(first_k_dense=k, dense_intermediate_size=c.intermediate_size)
    if n_exp > 0:
        out.update(num_experts=n_exp, top_k=c.num_experts_per_tok, moe_intermediate_size=c.moe_intermediate_size,
                   norm_topk_prob=bool(c.norm_topk_prob))
    if family == "qwen2_moe" and (c.shared_expert_intermediate_size or 0) > 0:
        out.update(shared_expert_intermediate_size=c.shared_expert_intermediate_size, shared_expert_gate=True)
    return out


def _generic_refusals(family: str, c) -> None:
    act = getattr(c, "hidden_act", "silu")
    if act != "silu":
        _refuse("hidden_act", act, "only SwiGLU with silu is supported")
    if getattr(c, "mlp_bias", False):
        _refuse("mlp_bias", True, "FFN projections with bias are not supported")
    if getattr(c, "clip_qkv", None) is not None:
        _refuse("clip_qkv", c.clip_qkv, "q/k/v clipping is not supported")
    if (getattr(c, "pretraining_tp", 1) or 1) != 1:
        _refuse("pretraining_tp", c.pretraining_tp, "only pretraining_tp = 1 is supported")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(c, name, None) is not None:
            _refuse(name, getattr(c, name), "logit soft-capping is not supported")
    _no_sliding_window(family, c)


def imported_config(hf_config) -> ConceptMoEConfig:
    """The plain-import config for a transformers config of a supported family."""
    family = hf_config.model_type
    if family not in FAMILIES:
        raise ValueError(f"model_type={family!r}: not an importable family (supported: {', '.join(FAMILIES)})")
    c = hf_config
    _generic_refusals(family, c)
    fields = dict(_attention_fields(family, c), **_moe_fields(family, c))
    fields.update(vocab_size=c.vocab_size, num_hidden_layers=c.num_hidden_layers,
                  tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
                  initializer_range=float(getattr(c, "initializer_range", 0.02)),
                  pad_token_id=getattr(c, "pad_token_id", None), bos_token_id=getattr(c, "bos_token_id", None),
                  eos_token_id=getattr(c, "eos_token_id", None), chunking=False)
    return ConceptMoEConfig(**fields)
