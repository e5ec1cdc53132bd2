"""Kernel-launching ops and host reads per decoded token (issue 35): one cached decoding step of the
plain MoE and of the ConceptMoE at batch 1 and 8, counted on the CPU by dispatch modes.

An op is every aten op the dispatcher runs except views (outputs aliasing an input, ``_unsafe_view``),
bare allocations (``empty*``) and the scalar reads themselves; the host reads are those of
tests/unit/modeling/test_host_syncs.py's ``HostReads`` (``.item()`` / ``int`` / ``bool``,
``.tolist()``, ``nonzero``, boolean-mask indexing, ...). The shapes are the GPU speed pair's
(configs/model/bench_moe_top8.yaml, bench_1l_top24_r2.yaml: 32 layers, 128 experts, top-8 / 24) at a
small width (the op count does not depend on widths); boundaries fixed at R = 2.

    .venv/bin/python scripts/decode_ops.py [--steps 8] [--prompt 64] [--batches 1,8] [--hist] [--transformers]
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path.cwd()  # the repository whose code is measured (run from its root)
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "unit" / "modeling")]

from test_host_syncs import HostReads

from vlm.modeling.configuration_conceptmoe import ConceptMoEConfig
from vlm.modeling.modeling_conceptmoe import ConceptMoEForCausalLM

SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "moe_intermediate_size": 16,
         "vocab_size": 512}
NOT_KERNELS = {"empty", "empty_like", "empty_strided", "_unsafe_view", "_local_scalar_dense"}


class OpCount(TorchDispatchMode):
    """Counts the kernel-launching aten ops (see the module docstring) by name."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NOT_KERNELS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def build(name: str, **overrides) -> ConceptMoEForCausalLM:
    cfg = ConceptMoEConfig.from_yaml(ROOT / "configs" / "model" / f"{name}.yaml", **{**SMALL, **overrides})
    torch.manual_seed(0)
    return ConceptMoEForCausalLM(cfg).eval()


@torch.no_grad()
def measure(model, batch: int, prompt: int, steps: int) -> dict:
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    state = model.start_decoding(batch, prompt + steps + 4)
    tok = model.prefill(state, ids).argmax(-1)
    tok = model.step(state, tok).argmax(-1)  # warm-up
    ops, reads, per_step = Counter(), 0, []
    for _ in range(steps):
        with HostReads() as hr, OpCount() as oc:
            tok = model.step(state, tok).argmax(-1)
        ops += oc.ops
        reads += len(hr.reads)
        per_step.append(sum(oc.ops.values()))
    return {"ops": sum(ops.values()) / steps, "min": min(per_step), "max": max(per_step), "syncs": reads / steps,
            "hist": ops}


@torch.no_grad()
def measure_transformers(batch: int, prompt: int, steps: int) -> dict:
    """transformers' Qwen3-MoE with a ``StaticCache`` at the plain pair's depth, experts and top-k (it
    has QK-norm, two RMSNorms more per layer)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM, StaticCache

    cfg = Qwen3MoeConfig(vocab_size=SMALL["vocab_size"], hidden_size=64, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    ids = torch.randint(1, cfg.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    cache = StaticCache(config=cfg, max_cache_len=prompt + steps + 4)
    out = model(ids, cache=cache, use_cache=True, cache_position=torch.arange(prompt))
    ops, reads, per_step = Counter(), 0, []
    for i in range(steps + 1):  # (the first step warms up)
        tok = out.logits[:, -1].argmax(-1)[:, None]
        with HostReads() as hr, OpCount() as oc:
            out = model(tok, cache=cache, use_cache=True, cache_position=torch.tensor([prompt + i]))
        if i:
            ops += oc.ops
            reads += len(hr.reads)
            per_step.append(sum(oc.ops.values()))
    return {"ops": sum(ops.values()) / steps, "min": min(per_step), "max": max(per_step), "syncs": reads / steps,
            "hist": ops}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--hist", action="store_true", help="print the ops by name")
    ap.add_argument("--transformers", action="store_true", help="also transformers' Qwen3-MoE with a StaticCache")
    args = ap.parse_args()
    torch.set_num_threads(1)
    models = {"MoE (bench_moe_top8)": build("bench_moe_top8"),
              "ConceptMoE (bench_1l_top24_r2, fixed R=2)": build("bench_1l_top24_r2", boundary_mode="fixed")}
    print("| model | batch | ops per token (mean) | fewest / most in a step | host reads per token |\n"
          "|---|---|---|---|---|")
    for label, model in models.items():
        for b in map(int, args.batches.split(",")):
            r = measure(model, b, args.prompt, args.steps)
            print(f"| {label} | {b} | {r['ops']:.1f} | {r['min']} / {r['max']} | {r['syncs']:.2f} |", flush=True)
            if args.hist:
                print(sorted(r["hist"].items(), key=lambda kv: -kv[1]))
    if args.transformers:
        for b in map(int, args.batches.split(",")):
            r = measure_transformers(b, args.prompt, args.steps)
            print(f"| transformers Qwen3-MoE, StaticCache | {b} | {r['ops']:.1f} | {r['min']} / {r['max']} | "
                  f"{r['syncs']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
