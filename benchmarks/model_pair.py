"""The models under test: a plain MoE and the ConceptMoE matched to it by the FLOPs accountant.

Speed comparisons use ``boundary_mode="fixed"`` (a boundary every round(R) tokens): the achieved
ratio is exactly R and the compute that of a learned router at ratio R, whereas a randomly
initialised router would give an arbitrary ratio.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks import ROOT

BENCH_CONFIGS = ROOT / "benchmarks" / "configs"
MODEL_CONFIGS = ROOT / "configs" / "model"
PAIRS = {"cpu": BENCH_CONFIGS / "pair_cpu.yaml", "gpu": BENCH_CONFIGS / "pair_gpu.yaml",
         "smoke": BENCH_CONFIGS / "pair_smoke.yaml"}
# the project's GPU speed pair (configs/model/), preferred over pair_gpu.yaml when present
PROJECT_GPU_PAIR = (MODEL_CONFIGS / "bench_moe_top8.yaml", MODEL_CONFIGS / "bench_1l_top24_r2.yaml")


def resolve_pair(spec: str) -> str:
    """A preset name (cpu, gpu, smoke) or a path spec -> ``BASE.yaml[:CONCEPT.yaml]``."""
    if spec == "gpu" and PROJECT_GPU_PAIR[0].is_file():
        base, con = PROJECT_GPU_PAIR
        return f"{base}:{con}" if con.is_file() else str(base)
    return str(PAIRS.get(spec, spec))


def add_pair_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--pair", default=None,
                    help="baseline plain-MoE YAML or a preset name (cpu, gpu, smoke; default by --sizes); "
                         "BASE.yaml:CONCEPT.yaml uses a given ConceptMoE config instead of solving one")
    ap.add_argument("--ratio", type=float, default=2.0, help="target compression ratio R")
    ap.add_argument("--strategy", default="topk", help="accountant matching strategy (topk = paper strategy 1)")


def load_pair(spec: str, ratio: float = 2.0, strategy: str = "topk", seq_len: int = 8192,
              boundary_mode: str = "fixed", **overrides) -> tuple:
    """(baseline_cfg, concept_cfg, info). The ConceptMoE is solved by ``vlm.flops.solve_match``
    (FLOP- and parameter-matched to the baseline, 1 encoder and 1 decoder layer: the "1L" shape)
    unless ``spec`` names both configs. Both use ``boundary_mode`` (default fixed, see above)."""
    from vlm.modeling.configuration_conceptmoe import ConceptMoEConfig
    path = resolve_pair(spec)
    concept_path = None
    if ":" in path:
        path, concept_path = path.split(":", 1)
    base = ConceptMoEConfig.from_yaml(path, **overrides)
    if base.chunking:
        raise SystemExit(f"{path}: the baseline of a pair must be a plain MoE (chunking off)")
    info = {"baseline_config": _rel(path)}
    if concept_path:
        con = ConceptMoEConfig.from_yaml(concept_path, boundary_mode=boundary_mode, **overrides)
        info["concept_config"] = _rel(concept_path)
        info["matching"] = "given"
    else:
        from vlm.flops import solve_match
        con = solve_match(base, strategy, ratio, encoder_layers=1, decoder_layers=1, seq_len=seq_len,
                          boundary_mode=boundary_mode)
        info["matching"] = dict(getattr(con, "solver_info", {}))
    info["boundary_mode"] = con.boundary_mode
    info.update(describe_pair(base, con, seq_len))
    return base, con, info


def _rel(path) -> str:
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


def describe_pair(base, con, seq_len: int) -> dict:
    from vlm.flops import count_params, describe, flops_per_token
    pb, pc = count_params(base), count_params(con)
    fb, fc = flops_per_token(base, seq_len), flops_per_token(con, seq_len)
    return {"baseline": describe(base), "concept": describe(con),
            "params_baseline": pb["total"], "params_concept": pc["total"],
            "param_diff": pc["total"] / pb["total"] - 1,
            "flops_no_attn_map_baseline": fb["total_no_attn_map"], "flops_no_attn_map_concept": fc["total_no_attn_map"],
            "flop_diff_no_attn_map": fc["total_no_attn_map"] / fb["total_no_attn_map"] - 1,
            "concept_top_k": con.concept_top_k, "top_k": base.top_k, "layers": base.num_hidden_layers,
            "split": f"{con.encoder_layers}/{con.concept_layers}/{con.decoder_layers}"}


def predicted_speedup(base, con, seq_len: int, ratio: float | None = None, causal_half: bool = False) -> float:
    """Accountant's forward FLOPs per token (attention map included) baseline / ConceptMoE - 1."""
    from vlm.flops import flops_per_token
    fb = flops_per_token(base, seq_len, causal_half=causal_half)["total"]
    fc = flops_per_token(con, seq_len, ratio=ratio, causal_half=causal_half)["total"]
    return fb / fc - 1


def build_model(cfg, device: torch.device, dtype: torch.dtype, seed: int = 0, train: bool = False):
    from vlm.modeling.modeling_conceptmoe import ConceptMoEForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the device (a 1B+ model's CPU init takes long)
        model = ConceptMoEForCausalLM(cfg)
    return model.to(dtype=dtype).train(train)


def random_ids(batch: int, length: int, vocab: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(1, vocab, (batch, length), generator=g).to(device)
