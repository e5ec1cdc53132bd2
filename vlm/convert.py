"""Continual-training conversion: a trained plain-MoE checkpoint -> a ConceptMoE checkpoint (paper
section 7); ``--check`` proves the R = 1 identity against the baseline.

    python -m vlm.convert --from runs/moe/hf --to runs/moe_to_concept --ratio 1.5 --strategy loop [--check]
    python -m vlm.convert --from <transformers folder> --to out [--ratio R --strategy topk|loop] [--check]

A transformers checkpoint (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE; see
``vlm/hf_import``) is imported first: without ``--ratio`` the result is that plain import (chunking off,
same logits; ``--check`` compares them with the transformers model's), with ``--ratio`` the imported
model is then converted as above (``--check``: the R = 1 identity against the transformers model).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from vlm.modeling.configuration_conceptmoe import ConceptMoEConfig
from vlm.flops.matching import solve_match
from vlm.hf_import import hf_family, import_hf
from vlm.modeling.modeling_conceptmoe import ConceptMoEForCausalLM
from vlm.modeling.safe_loading import require_safetensors

CHUNKER_KEYS = ("chunker.", "q_c_proj", "k_c_proj", "v_c_proj", "concept_in", "concept_out")


def _load_kind(path: Path) -> str:
    cfg = json.loads((path / "config.json").read_text())
    return cfg.get("model_type", "")


def converted_text_config(base: ConceptMoEConfig, ratio: float, strategy: str, encoder_layers=None,
                          decoder_layers=None, joint_decoding_layers: int = 4) -> ConceptMoEConfig:
    if base.chunking:
        raise ValueError("the source checkpoint already has chunking on: convert a plain MoE")
    return solve_match(base, strategy, ratio, encoder_layers=encoder_layers, decoder_layers=decoder_layers,
                       joint_decoding_layers=joint_decoding_layers, max_expert_cut=0.0, concept_merge="last",
                       router_init="random")


def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> list[str]:
    """Load every source weight into ``dst``; returns the new (chunker / joint) parameter names."""
    result = dst.load_state_dict(src.state_dict(), strict=False)
    if result.unexpected_keys:
        raise ValueError(f"weights with no home in the converted model: {result.unexpected_keys[:5]}")
    bad = [k for k in result.missing_keys if not any(tag in k for tag in CHUNKER_KEYS)]
    if bad:
        raise ValueError(f"converted model has weights the baseline lacks: {bad[:5]}")
    return list(result.missing_keys)


def identity_config(cfg: ConceptMoEConfig) -> ConceptMoEConfig:
    """The converted architecture at R = 1: every token a concept, baseline top-k, no loops."""
    d = cfg.to_dict()
    for key in ("model_type", "transformers_version", "architectures"):
        d.pop(key, None)
    d.update(boundary_mode="all", concept_top_k=None, concept_loop_layers=[], concept_loop_times=1)
    return ConceptMoEConfig(**d)


def _load_base(cls, src: Path):
    """from_pretrained, with a weights file that cannot be parsed (corrupt, or not safetensors) as one line."""
    from safetensors import SafetensorError

    try:
        return cls.from_pretrained(src)
    except (SafetensorError, OSError) as err:
        first = (str(err).splitlines() or [type(err).__name__])[0]
        raise ValueError(f"{src}: cannot read the weights ({first})") from None


def convert(src: Path, dst: Path, ratio: float | None, strategy: str, encoder_layers=None, decoder_layers=None,
            joint_decoding_layers: int = 4, seed: int = 0):
    """Convert the HF export ``src`` (a plain MoE, LM or VLM) into a ConceptMoE at ``dst``.

    What it does (the paper's conversion path, section 7):
    - copies every weight of the baseline (embeddings, all layers, norms, head; for a VLM also the
      vision tower and projector): the layer stack is split into L_E encoder / L_C concept / L_D decoder
      layers with unchanged parameter names, so nothing is re-initialised;
    - adds the chunk router with RANDOM init, uses ``concept_merge: last`` (keeps the initial loss
      close to the baseline's), zero-initialises the joint-decoding projections;
    - gives the saved compute back as the FLOP matcher solves (``vlm/flops/matching.py``), here with the
      experts kept as they are (no expert is dropped, so every weight has a home): ``topk`` raises the
      concept layers' top-k, ``loop`` also re-runs middle concept layers with their own weights.

    Identity check (``--check``): with every token forced to be a concept (``boundary_mode: all``,
    R = 1) the matcher has no compute to give back, i.e. the baseline's top-k and no loops; in that
    setting the converted model's logits equal the baseline's. The check runs that and prints the
    largest logit difference.
    """
    require_safetensors(src)
    kind = _load_kind(src)
    torch.manual_seed(seed)
    family = hf_family(src)
    if family is None and ratio is None:
        ratio = 1.5  # our own checkpoints: the default target
    if family is not None:  # a transformers checkpoint: the plain import first
        base = import_hf(src)
        if ratio is None:
            dst.mkdir(parents=True, exist_ok=True)
            base.save_pretrained(dst)
            _copy_extras(src, dst)
            return base, base, []
        if base.config.first_k_dense >= base.config.num_hidden_layers:
            raise ValueError(f"first_k_dense={base.config.first_k_dense}: --ratio needs routed experts, a dense "
                             f"{family} model has none to give the saved compute back with "
                             "(import it without --ratio)")
        model = ConceptMoEForCausalLM(converted_text_config(base.config, ratio, strategy, encoder_layers,
                                                            decoder_layers, joint_decoding_layers))
    elif kind == "conceptmoe_vlm":
        from vlm.modeling.modeling_conceptmoe_vl import ConceptMoEVLMForConditionalGeneration
        base = _load_base(ConceptMoEVLMForConditionalGeneration, src)
        new_text = converted_text_config(base.config.text_config, ratio, strategy, encoder_layers, decoder_layers,
                                         joint_decoding_layers)
        cfg = base.config.__class__(vision=base.config.vision, projector=base.config.projector, text_config=new_text,
                                    image_token_id=base.config.image_token_id,
                                    im_start_token_id=base.config.im_start_token_id,
                                    im_end_token_id=base.config.im_end_token_id)
        model = ConceptMoEVLMForConditionalGeneration(cfg)
    elif kind == "conceptmoe":
        base = _load_base(ConceptMoEForCausalLM, src)
        model = ConceptMoEForCausalLM(converted_text_config(base.config, ratio, strategy, encoder_layers,
                                                            decoder_layers, joint_decoding_layers))
    else:
        from vlm.hf_import import FAMILIES
        raise ValueError(f"{src}: model_type {kind!r} is neither a ConceptMoE checkpoint nor an importable "
                         f"transformers family ({', '.join(FAMILIES)})")
    new_keys = copy_weights(base, model)
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    _copy_extras(src, dst)
    return base, model, new_keys


def _copy_extras(src: Path, dst: Path) -> None:
    for extra in ("processor_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "chat_template.jinja", "chat_template.json", "preprocessor_config.json"):
        if (src / extra).exists():
            shutil.copy2(src / extra, dst / extra)


@torch.no_grad()
def identity_gap(base, model, vocab: int, seq_len: int = 32, seed: int = 0) -> float:
    """Largest |logit difference| between the baseline and the converted model run at R = 1."""
    text = getattr(model, "language_model", model)
    base_text = getattr(base, "language_model", base)
    at_r1 = ConceptMoEForCausalLM(identity_config(text.config))
    copy_weights(text, at_r1)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, seq_len), generator=g)
    return float((at_r1.eval()(ids).logits - base_text.eval()(ids).logits).abs().max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="src", required=True, help="HF export of a plain MoE (LM or VLM)")
    ap.add_argument("--to", dest="dst", required=True)
    ap.add_argument("--ratio", type=float, default=None,
                    help="target ratio R (default 1.5; for a transformers checkpoint none = the plain import)")
    ap.add_argument("--strategy", choices=("topk", "loop"), default="topk")
    ap.add_argument("--encoder-layers", type=int, default=None)
    ap.add_argument("--decoder-layers", type=int, default=None)
    ap.add_argument("--joint-layers", type=int, default=4)
    ap.add_argument("--check", action="store_true", help="verify the R = 1 identity and print the gap")
    args = ap.parse_args(argv)
    src, dst = Path(args.src), Path(args.dst)
    if not (src / "config.json").is_file():
        print(f"error: {src} is not a checkpoint folder (no config.json)", file=sys.stderr)
        return 2
    try:
        base, model, new_keys = convert(src, dst, args.ratio, args.strategy, args.encoder_layers,
                                        args.decoder_layers, args.joint_layers)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    family = hf_family(src)
    if family is not None and args.ratio is None:
        print(f"imported {src} ({family}) -> {dst}: plain ConceptMoE (chunking off), "
              f"{sum(p.numel() for p in model.parameters())} parameters")
        if args.check:
            from vlm.hf_import.check import logit_gap, reference_model
            gap = logit_gap(model, reference_model(src), model.config.vocab_size)
            print(f"import check: max |logit difference| vs transformers = {gap:.3e}")
            return 1 if gap > 1e-4 else 0
        return 0
    text = getattr(model, "language_model", model).config
    print(f"converted {src} -> {dst}: L_E={text.encoder_layers} L_C={text.concept_layers} "
          f"L_D={text.decoder_layers} R={text.target_ratio} concept_top_k={text.concept_top_k} "
          f"loops={text.concept_loop_layers}x{text.concept_loop_times} joint={text.joint_decoding_layers}; "
          f"{len(new_keys)} new tensors (chunker, joint decoding)")
    if args.check:
        if family is not None:  # the R = 1 identity against the transformers model itself
            from vlm.hf_import.check import reference_model
            base = reference_model(src)
        gap = identity_gap(base, model, text.vocab_size)
        print(f"R=1 identity check: max |logit difference| = {gap:.3e}")
        if gap > 1e-4:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
