"""Importing transformers checkpoints (``python -m vlm.convert --from <HF folder>``): for each family a
small random model built with transformers' own classes, saved as safetensors, imported, reloaded with
``ConceptMoEForCausalLM.from_pretrained`` and compared in fp32 on a left-padded batch of 2."""
import json

import pytest
import torch
import transformers as T

from vlm import ConceptMoEForCausalLM
from vlm.convert import main
from vlm.hf_import import import_hf
from vlm.hf_import.check import logit_gap
from vlm.modeling.attention import rope_inv_freq

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5)
_MOE = dict(num_experts=4, num_experts_per_tok=2)
FAMILIES = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, dict(rope_theta=5e5)),
    "llama_bias_tied": (T.LlamaConfig, T.LlamaForCausalLM, dict(attention_bias=True, tie_word_embeddings=True)),
    "llama_rope_llama3": (T.LlamaConfig, T.LlamaForCausalLM, dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "llama_rope_linear": (T.LlamaConfig, T.LlamaForCausalLM, dict(rope_parameters={
        "rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(sliding_window=None, head_dim=16)),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}),
    "qwen2_rope_yarn": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(max_position_embeddings=128, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32})),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(head_dim=16)),
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, dict(_MOE, moe_intermediate_size=16, norm_topk_prob=True)),
    "qwen3_moe_dense0": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, dict(_MOE, moe_intermediate_size=16,
                                                                       mlp_only_layers=[0])),
    "olmoe": (T.OlmoeConfig, T.OlmoeForCausalLM, dict(_MOE, eos_token_id=2, pad_token_id=1)),
    "qwen2_moe": (T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM, dict(_MOE, moe_intermediate_size=16,
                                                                shared_expert_intermediate_size=24)),
}


def _save(tmp_path, cfg_cls, model_cls, extra, name="hf"):
    """A seeded random transformers model, norms and biases perturbed (not their identity init)."""
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**SMALL, **extra})).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(tmp_path / name)
    return model, tmp_path / name


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_plain_import_matches_transformers_logits(tmp_path, family, capsys):
    ref, src = _save(tmp_path, *FAMILIES[family])
    assert main(["--from", str(src), "--to", str(tmp_path / "out")]) == 0
    assert "imported" in capsys.readouterr().out
    ours = ConceptMoEForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert not ours.config.chunking and ours.config.vocab_size == SMALL["vocab_size"]
    gap = logit_gap(ours, ref, SMALL["vocab_size"])
    print(f"{family}: max |logit diff| = {gap:.2e}")
    assert gap <= 1e-4


ROPE_FAMILIES = ["llama", "llama_rope_llama3", "llama_rope_linear", "qwen2_rope_yarn", "qwen3"]


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_rope_inverse_frequencies_equal_transformers_buffer(tmp_path, family):
    """The imported model's RoPE inverse frequencies and cos/sin scale are exactly transformers' own
    (``rotary_emb.inv_freq`` / ``attention_scaling``): the logit tolerance alone would let a permuted
    or slightly wrong high-frequency row through."""
    ref, src = _save(tmp_path, *FAMILIES[family])
    cfg = import_hf(src).config
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    inv_freq, scale = rope_inv_freq(head_dim, cfg.rope_theta, cfg.rope_scaling_params)
    want = ref.model.rotary_emb.inv_freq
    assert inv_freq.dtype == want.dtype and torch.equal(inv_freq, want), (inv_freq, want)
    assert scale == ref.model.rotary_emb.attention_scaling


def test_features_are_carried_over(tmp_path):
    _, src = _save(tmp_path, *FAMILIES["qwen2_moe"])
    cfg = import_hf(src).config
    assert (cfg.qkv_bias, cfg.o_proj_bias, cfg.qk_norm) == (True, False, "none")
    assert (cfg.shared_expert_intermediate_size, cfg.shared_expert_gate, cfg.norm_topk_prob) == (24, True, False)
    _, src = _save(tmp_path, *FAMILIES["olmoe"], name="olmoe")
    assert import_hf(src).config.qk_norm == "full"
    _, src = _save(tmp_path, *FAMILIES["qwen3_moe_dense0"], name="q3")
    cfg = import_hf(src).config
    assert (cfg.qk_norm, cfg.first_k_dense, cfg.dense_intermediate_size, cfg.norm_topk_prob) == ("head", 1, 48, False)
    _, src = _save(tmp_path, *FAMILIES["llama"], name="llama")
    cfg = import_hf(src).config
    assert (cfg.first_k_dense, cfg.dense_intermediate_size, cfg.rope_theta) == (3, 48, 5e5)
    _, src = _save(tmp_path, *FAMILIES["llama_bias_tied"], name="tied")
    model = import_hf(src)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight


REFUSED = [
    ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "rope_type"),
    ("llama", dict(hidden_act="gelu"), "hidden_act"),
    ("llama", dict(mlp_bias=True), "mlp_bias"),
    ("mixtral", dict(sliding_window=8), "sliding_window"),
    ("mistral", dict(sliding_window=8), "sliding_window"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), "sliding_window"),
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv"),
    ("qwen3_moe", dict(mlp_only_layers=[1]), "mlp_only_layers"),
    ("qwen2_moe", dict(decoder_sparse_step=2), "decoder_sparse_step"),
]


@pytest.mark.parametrize("family,extra,field", REFUSED, ids=[r[2] + "-" + r[0] for r in REFUSED])
def test_unsupported_features_are_refused_in_one_line(tmp_path, capsys, family, extra, field):
    cfg_cls, model_cls, base = FAMILIES[family]
    _, src = _save(tmp_path, cfg_cls, model_cls, {**base, **extra})
    capsys.readouterr()  # transformers' own save progress
    assert main(["--from", str(src), "--to", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and field in err, err
    assert not (tmp_path / "out").exists()


def test_cli_check_against_transformers(tmp_path, capsys):
    _, src = _save(tmp_path, *FAMILIES["qwen3_moe"])
    assert main(["--from", str(src), "--to", str(tmp_path / "out"), "--check"]) == 0
    assert "import check" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "conceptmoe" and cfg["qk_norm"] == "head"


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_ratio_after_import_keeps_the_r1_identity_against_transformers(tmp_path, capsys, family):
    _, src = _save(tmp_path, *FAMILIES[family])
    capsys.readouterr()
    assert main(["--from", str(src), "--to", str(tmp_path / "out"), "--ratio", "1.5", "--strategy", "loop",
                 "--check"]) == 0
    out = capsys.readouterr().out
    assert "R=1 identity check" in out
    converted = ConceptMoEForCausalLM.from_pretrained(tmp_path / "out")
    assert converted.config.chunking and converted.config.qk_norm == import_hf(src).config.qk_norm


@torch.no_grad()
def test_imported_model_generates_like_transformers(tmp_path):
    """Cached decoding (our KV cache, QK-norm and biases in the decode step) against transformers'
    greedy generate on a left-padded batch."""
    ref, src = _save(tmp_path, *FAMILIES["qwen2_moe"])
    ours = import_hf(src)
    ids = torch.randint(3, SMALL["vocab_size"], (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    a = ours.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=-1, pad_token_id=0)
    b = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None,
                     pad_token_id=0)
    assert torch.equal(a[:, -6:], b[:, -6:])


def test_fused_expert_layout_sharded_and_bf16_checkpoints(tmp_path):
    """transformers' in-memory layout (``experts.gate_up_proj`` [E, 2I, D], ``experts.down_proj``), a
    sharded checkpoint (``model.safetensors.index.json``) and bf16 weights (kept in bf16)."""
    import shutil

    from safetensors.torch import save_file

    ref, src = _save(tmp_path, *FAMILIES["qwen2_moe"])
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd
    (tmp_path / "fused").mkdir()
    shutil.copy(src / "config.json", tmp_path / "fused" / "config.json")
    save_file(sd, str(tmp_path / "fused" / "model.safetensors"))
    assert logit_gap(import_hf(tmp_path / "fused"), ref, SMALL["vocab_size"]) <= 1e-4
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert logit_gap(import_hf(tmp_path / "sharded"), ref, SMALL["vocab_size"]) <= 1e-4
    ref.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert import_hf(tmp_path / "bf16").model.embed_tokens.weight.dtype == torch.bfloat16


def test_ratio_on_a_dense_import_is_refused_in_one_line(tmp_path, capsys):
    _, src = _save(tmp_path, *FAMILIES["qwen3"])
    capsys.readouterr()
    assert main(["--from", str(src), "--to", str(tmp_path / "out"), "--ratio", "1.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "first_k_dense" in err and "dense qwen3" in err, err


def test_unknown_family_is_refused(tmp_path, capsys):
    torch.manual_seed(0)
    T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)).save_pretrained(tmp_path / "g")
    capsys.readouterr()
    assert main(["--from", str(tmp_path / "g"), "--to", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'gpt2'" in err and "qwen2_moe" in err, err
