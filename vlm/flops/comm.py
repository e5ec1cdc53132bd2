"""Expert-parallel communication and memory accountant: the all-to-all bytes one GPU sends per
training step (``a2a_bytes_per_step``) and the per-GPU memory of the expert parameters with and
without expert parallelism (``expert_memory_per_gpu``); ``ep_table`` prints both for one or two
configs (CLI: ``python -m vlm.flops --config X [--match-to Y] --ep 8``).

Conventions (read these before quoting a number):

- Dropless all-to-all as in ``vlm.training.expert_parallel``: every (token, expert) assignment whose
  expert lives on another rank of the EP group sends the token's hidden vector there (dispatch) and
  gets the expert output back (combine). Routing is assumed BALANCED (each expert gets its share,
  experts uniformly placed), so a fraction (ep - 1) / ep of the assignments leaves the rank: per MoE
  layer and token, dispatch = combine = ``top_k * width * dtype_bytes * (ep - 1) / ep`` bytes
  sent (and as many received). The backward sends the same again (the gradients of both exchanges,
  in reverse). A skewed router sends more from the ranks it favours' peers; this is the mean.
- Concept layers run on concepts: tokens / R of them (per run, for looped layers), at their own
  top-k (``chunking.concept_top_k``) and width (``concept_hidden_size``). Dense layers send nothing;
  a shared expert is local (no traffic).
- The per-layer counts exchange (``E`` int64 split sizes, (ep - 1) / ep of them leave the rank) is
  counted separately (``counts``); it is tiny.
- Memory: mixed precision with Adam, bf16 weights and gradients (``param_bytes`` = ``grad_bytes`` =
  2) and fp32 master weights + Adam m and v (``optim_bytes`` = 12) per parameter. Expert parameters
  live on ``1 / ep`` of the ranks; DeepSpeed partitions ZeRO-1/2 state of expert parameters over
  the expert-data-parallel group (``world / ep`` ranks), that of the others over all ``world``
  ranks. So per GPU: weights ``P / ep`` (replicated inside the expert-data-parallel group), the
  optimizer states ``P / world`` (ZeRO-1/2, whatever ep), the gradients ``P / ep`` (ZeRO-1) or
  ``P / world`` (ZeRO-2). EP saves the replicated weights (and ZeRO-1 gradients); ZeRO already
  spreads the optimizer state. Activations and buffers are not counted.
"""
from __future__ import annotations

from vlm.flops.accountant import Arch, _fmt, _ratio, describe

COUNT_BYTES = 8  # the split sizes travel as int64


def a2a_bytes_per_step(cfg, tokens: int, ep: int, dtype_bytes: int = 2, ratio: float | None = None) -> dict:
    """All-to-all bytes ONE GPU sends in one training step (forward + backward) of ``tokens`` tokens
    with expert-parallel size ``ep`` (see the module docstring). Keys: ``token_layers`` / ``concept_layers``
    (dispatch + combine, forward + backward), ``forward``, ``backward``, ``counts``, ``total``, and
    ``per_token`` (total / tokens), ``moe_layers`` and ``concept_tokens`` (tokens / R)."""
    a = Arch.of(cfg)
    R = _ratio(a, ratio)
    away = (ep - 1) / ep
    out = {"token_layers": 0.0, "concept_layers": 0.0, "counts": 0.0, "moe_layers": 0}
    for kind, width, dense, k, _joint, runs in a.layers():
        if dense:
            continue
        n = tokens * runs / R if kind == "con" else float(tokens)
        one_way = n * k * width * dtype_bytes * away  # dispatch (= combine) bytes, forward
        out["concept_layers" if kind == "con" else "token_layers"] += 4 * one_way  # (dispatch + combine) x (fwd + bwd)
        out["counts"] += runs * a.E * COUNT_BYTES * away  # forward only: the backward reuses the splits
        out["moe_layers"] += runs
    moved = out["token_layers"] + out["concept_layers"]
    out["forward"] = out["backward"] = moved / 2
    out["total"] = moved + out["counts"]
    out["per_token"] = out["total"] / tokens
    out["concept_tokens"] = tokens / R
    return out


def expert_params(cfg) -> int:
    """Routed-expert parameters of the model (the part EP shards; shared experts and routers are not)."""
    a = Arch.of(cfg)
    return sum(3 * a.E * width * a.inter for _k, width, dense, *_ in a.layers() if not dense)


def expert_memory_per_gpu(cfg, ep: int, world: int, zero_stage: int = 2, param_bytes: int = 2,
                          grad_bytes: int = 2, optim_bytes: int = 12) -> dict:
    """Bytes of routed-expert weights, gradients and optimizer state (fp32 master + Adam m, v) per
    GPU under ZeRO-``zero_stage`` (1 or 2) with expert-parallel size ``ep`` on ``world`` GPUs."""
    if zero_stage not in (1, 2):
        raise ValueError(f"zero_stage {zero_stage}: EP is served with ZeRO-1/2 (ZeRO-3 with EP is refused)")
    if world % ep:
        raise ValueError(f"ep {ep} must divide world {world}")
    P = expert_params(cfg)
    local = P / ep
    edp = world // ep  # the expert-data-parallel group that partitions the local experts' ZeRO state
    out = {"expert_params": P, "local_params": local,
           "weights": local * param_bytes,
           "grads": local * grad_bytes / (edp if zero_stage == 2 else 1),
           "optimizer": local * optim_bytes / edp}
    out["total"] = out["weights"] + out["grads"] + out["optimizer"]
    return out


def zero3_gather_bytes(cfg, world: int, param_bytes: int = 2) -> float:
    """Bytes one GPU receives per micro-batch when ZeRO-3 WITHOUT EP all-gathers every expert
    forward and again backward and reduce-scatters the gradients: 3 x P x bytes x (world - 1) / world."""
    return 3 * expert_params(cfg) * param_bytes * (world - 1) / world


def ep_summary(cfg, tokens: int, ep: int, world: int, dtype_bytes: int = 2, zero_stage: int = 2,
               ratio: float | None = None) -> dict:
    """The numbers ``ep_table`` shows (bytes)."""
    comm = a2a_bytes_per_step(cfg, tokens, ep, dtype_bytes, ratio)
    m1 = expert_memory_per_gpu(cfg, 1, world, zero_stage, dtype_bytes, dtype_bytes)
    mep = expert_memory_per_gpu(cfg, ep, world, zero_stage, dtype_bytes, dtype_bytes)
    return {"all-to-all bytes/step/GPU (fwd+bwd)": comm["total"],
            "  token layers": comm["token_layers"], "  concept layers": comm["concept_layers"],
            "  counts exchange": comm["counts"], "all-to-all bytes/token": comm["per_token"],
            "ZeRO-3 without EP: expert bytes gathered/micro-batch/GPU": zero3_gather_bytes(cfg, world, dtype_bytes),
            "expert params (total)": m1["expert_params"],
            "expert memory/GPU, EP=1": m1["total"], f"expert memory/GPU, EP={ep}": mep["total"],
            f"saved by EP={ep}": m1["total"] - mep["total"]}


def ep_table(cfgs: dict, tokens: int = 8192, ep: int = 8, world: int | None = None, dtype_bytes: int = 2,
             zero_stage: int = 2, ratio: float | None = None) -> str:
    """Markdown table, one column per config (``{name: cfg}``); bytes in B / KB / MB / GB (powers of 10)."""
    world = world or ep
    sums = {name: ep_summary(cfg, tokens, ep, world, dtype_bytes, zero_stage, ratio) for name, cfg in cfgs.items()}
    names = list(sums)
    lines = [f"| EP = {ep} on {world} GPUs, {tokens} tokens/GPU/step, {dtype_bytes}-byte activations, "
             f"ZeRO-{zero_stage} | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for key in sums[names[0]]:
        unit = "" if key.startswith("expert params") else "B"
        lines.append(f"| {key} | " + " | ".join(_fmt(sums[n][key], unit) for n in names) + " |")
    lines.append("")
    lines += [f"{n}: {describe(c)}" for n, c in cfgs.items()]
    lines.append("(balanced routing: (ep-1)/ep of the assignments leave the rank; memory = bf16 weights + "
                 "grads, fp32 master + Adam m, v; expert ZeRO state partitioned over world/ep ranks)")
    return "\n".join(lines)
