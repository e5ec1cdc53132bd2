"""Expert parallelism on CPU: one MoE layer's forward + backward with its experts sharded over 2 gloo
ranks (``ExpertParallelMoE``) vs the same layer unsharded on each rank (plain data parallelism).

Each rank routes its own tokens (the same tokens in both variants, the same weights). ``dp``: the
full ``MoEFeedForward`` (every expert) on the rank's tokens. ``ep``: ``ExpertParallelMoE`` holding
E / ranks experts: counts exchange, one host sync for the split sizes, dispatch all-to-all, grouped
SwiGLU over the received rows, combine all-to-all (and the reverse exchanges in the backward).
``ep_exchanges``: those exchanges alone (counts + host sync + 2 forward and 2 backward all-to-alls
of the same split sizes and row counts), replayed with ``torch.distributed.all_to_all_single``: the
all-to-all share of the EP time. All three run in the same interleaved rounds, the ranks aligned by
a barrier (untimed) before every measurement; a round's time is the slower rank's (a synchronous
step waits for it). The ratio EP / DP is the median of per-round ratios.

On CPU there is no network: gloo's all-to-all between two processes on one machine is a memory copy
through the loopback; the ratio measures the dispatch overhead (the extra gathers, sorts and copies
and the synchronisation between ranks), not a GPU interconnect. Gradient reduction is not part of
the layer and not timed (DP all-reduces every expert's gradient each step; EP over all ranks none).

The accountant's rows (``vlm.flops.comm``: all-to-all bytes per step, expert memory per GPU, for the
paper-size presets) are COMPUTED, not timed.

    python -m benchmarks.expert_parallel [--sizes 1K,4K] [--ranks 2] [--smoke]
"""
from __future__ import annotations

import copy
import json
import os
import tempfile
from pathlib import Path

import torch

from benchmarks import ROOT
from benchmarks.cli import base_parser, logger, setup
from benchmarks.harness import stats
from benchmarks.machine import available_cores
from benchmarks.report import fmt_median_iqr, fmt_ratio, md_table, settings_line

NAME = "expert_parallel"
PRESETS = {"smoke": [64], "cpu": [1024, 4096]}  # tokens per rank
REPS = {"smoke": 1, "cpu": 15}
SHAPES = {"smoke": dict(hidden=32, experts=4, top_k=2, inter=32),
          "cpu": dict(hidden=256, experts=8, top_k=2, inter=512)}
PAPER = ("moe_a05b_12b", "concept_a05b_12b")  # the accountant's presets (configs/model)
PAPER_STEP = dict(tokens=8192, ep=8, world=8, dtype_bytes=2, zero_stage=2)


def exchange_plan(layer, x_ND: torch.Tensor) -> dict:
    """The split sizes ``ExpertParallelMoE.experts_sorted`` uses for ``x_ND`` (collective: every rank
    of the layer's group must call it): the rows sent to / received from each rank and the counts."""
    import torch.distributed as dist
    with torch.no_grad():
        _, _, _, experts_NK = layer.route(x_ND)
    E, P = layer.num_experts, layer.ep_size
    counts_E = torch.bincount(experts_NK.reshape(-1), minlength=E)
    recv_E = torch.empty_like(counts_E)
    dist.all_to_all_single(recv_E, counts_E, group=layer.ep_group)
    send = counts_E.view(P, -1).sum(1).tolist()
    recv = recv_E.view(P, -1).sum(1).tolist()
    return {"counts_E": counts_E, "send": send, "recv": recv}


def make_exchanges(layer, plan: dict, D: int, dtype: torch.dtype):
    """The EP layer's exchanges alone, same sizes: counts, host sync, dispatch / combine forward and
    their gradients backward (combine's gradient goes out like the dispatch, and vice versa)."""
    import torch.distributed as dist
    g, send, recv, counts_E = layer.ep_group, plan["send"], plan["recv"], plan["counts_E"]
    n_send, n_recv = sum(send), sum(recv)
    tx, rx = torch.randn(n_send, D, dtype=dtype), torch.randn(n_recv, D, dtype=dtype)
    out_rx, out_tx = torch.empty(n_recv, D, dtype=dtype), torch.empty(n_send, D, dtype=dtype)
    recv_E = torch.empty_like(counts_E)

    def fn():
        dist.all_to_all_single(recv_E, counts_E, group=g)
        recv_E.tolist()  # the host sync for the split sizes
        dist.all_to_all_single(out_rx, tx, recv, send, group=g)  # dispatch
        dist.all_to_all_single(out_tx, rx, send, recv, group=g)  # combine
        dist.all_to_all_single(out_rx, tx, recv, send, group=g)  # backward: combine's gradient
        dist.all_to_all_single(out_tx, rx, send, recv, group=g)  # backward: dispatch's gradient
    return fn


def _fwd_bwd(layer, x, grad_out):
    xg = x.detach().clone().requires_grad_(True)

    def fn():
        for p in layer.parameters():
            p.grad = None
        xg.grad = None
        layer(xg)[0].backward(grad_out)
    return fn, xg


def _worker(rank: int, world: int, port: int, job: dict, out_path: str) -> None:
    """One rank: build both layers, check they agree, time the interleaved rounds, send times to rank 0."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch.distributed as dist
    from deepspeed.utils import groups

    from benchmarks.harness import interleaved
    from benchmarks.moe import build_ours
    from vlm.training.distributed import init_distributed
    from vlm.training.expert_parallel import ExpertParallelMoE, create_groups

    init_distributed("cpu", timeout_s=job["timeout_s"], cpu_threads=job["threads"])
    name = create_groups(world)  # EP over every rank: the expert-data-parallel groups have size 1
    group, ep_rank = groups._get_expert_parallel_group(name), groups._get_expert_parallel_rank(name)
    dtype, shape = getattr(torch, job["dtype"]), job["shape"]
    D, cpu = shape["hidden"], torch.device("cpu")
    results = []
    for T in job["sizes"]:
        dense = build_ours(shape, "sorted", cpu, dtype, job["seed"])  # same weights on every rank
        ep = ExpertParallelMoE(copy.deepcopy(dense), world, ep_rank)
        ep.ep_group = group  # what the engine's set_deepspeed_parallelism does; no engine here
        gen = torch.Generator().manual_seed(job["seed"] + 1000 * rank + T)  # each rank its own tokens
        x = torch.randn(1, T, D, generator=gen).to(dtype)
        grad_out = torch.randn(1, T, D, generator=gen).to(dtype)
        fn_dp, x_dp = _fwd_bwd(dense, x, grad_out)
        fn_ep, x_ep = _fwd_bwd(ep, x, grad_out)
        fn_dp()
        fn_ep()
        with torch.no_grad():
            out_diff = float((dense(x)[0] - ep(x)[0]).abs().max())
        diff = {"output": out_diff, "input_grad": float((x_dp.grad - x_ep.grad).abs().max())}
        plan = exchange_plan(ep, x.reshape(T, D))
        variants = {"dp": fn_dp, "ep": fn_ep, "ep_exchanges": make_exchanges(ep, plan, D, dtype)}
        comp = interleaved(variants, cpu, job["reps"], job["warmup"], between=lambda _n: dist.barrier(group=group))
        mine = {"rank": rank, "tokens": T, "times": comp.times, "order": comp.order, "max_abs_diff": diff,
                "rows_sent": sum(plan["send"]) - plan["send"][ep_rank],
                "rows_received": sum(plan["recv"]) - plan["recv"][ep_rank], "assignments": T * shape["top_k"]}
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        results.append(gathered)
        del dense, ep, fn_dp, fn_ep, variants
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def launch(job: dict, ranks: int, start_method: str) -> list:
    """Run ``_worker`` on ``ranks`` local processes; the per-size, per-rank results of rank 0's file."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from torch.distributed.elastic.utils.distributed import get_free_port

    if start_method == "auto":  # fork reuses this process's imports (deepspeed: ~20 s a process on 2 cores)
        start_method = "spawn" if dist.is_available() and dist.is_initialized() else "fork"
    if start_method == "fork":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as init_distributed("cpu") sets it, before the import
        import deepspeed.utils.groups  # noqa: F401 - imported once here, inherited by the forked ranks

        import vlm.training.expert_parallel  # noqa: F401
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        mp.start_processes(_worker, args=(ranks, get_free_port(), job, str(out)), nprocs=ranks, join=True,
                           start_method=start_method)
        return json.loads(out.read_text())


def summarise(per_rank: list) -> dict:
    """Per-round times = the slowest rank's; EP / DP and exchanges / EP as medians of per-round ratios."""
    rounds = {v: [max(r["times"][v][i] for r in per_rank) for i in range(len(per_rank[0]["times"][v]))]
              for v in per_rank[0]["times"]}
    ratio = [e / d for e, d in zip(rounds["ep"], rounds["dp"])]
    share = [x / e for x, e in zip(rounds["ep_exchanges"], rounds["ep"])]
    return {"tokens_per_rank": per_rank[0]["tokens"], "seconds": {v: stats(t) for v, t in rounds.items()},
            "ep_over_dp": stats(ratio), "exchange_share_of_ep": stats(share), "round_times": rounds,
            "per_rank": [{"rank": r["rank"], "median_s": {v: stats(t)["median"] for v, t in r["times"].items()},
                          "rows_sent": r["rows_sent"], "rows_received": r["rows_received"],
                          "assignments": r["assignments"], "max_abs_diff": r["max_abs_diff"]} for r in per_rank]}


def accountant_rows() -> tuple[dict, list]:
    """The paper-size presets through ``vlm.flops.comm`` (computed, not timed)."""
    from vlm.modeling.configuration_conceptmoe import ConceptMoEConfig
    from vlm.flops.accountant import _fmt
    from vlm.flops.comm import ep_summary
    cfgs = {n: ConceptMoEConfig.from_yaml(ROOT / "configs" / "model" / f"{n}.yaml") for n in PAPER}
    k = cfgs[PAPER[0]].top_k
    cfgs[f"{PAPER[1]} (concept top-k {k})"] = ConceptMoEConfig.from_yaml(
        ROOT / "configs" / "model" / f"{PAPER[1]}.yaml", concept_top_k=k)  # R alone, no strategy-1 extra experts
    p = PAPER_STEP
    sums = {n: ep_summary(c, p["tokens"], p["ep"], p["world"], p["dtype_bytes"], p["zero_stage"])
            for n, c in cfgs.items()}
    rows = [[key] + [_fmt(s[key], "" if key.startswith("expert params") else "B") for s in sums.values()]
            for key in next(iter(sums.values()))]
    return sums, rows


def run(argv=None) -> dict:
    ap = base_parser(NAME, __doc__.split("\n")[0], "tokens per rank, e.g. 1K,4K")
    ap.add_argument("--ranks", type=int, default=2, help="gloo processes = expert-parallel size (default 2)")
    ap.add_argument("--shape", default=None, help="smoke | cpu or hidden,experts,top_k,inter (default by preset)")
    ap.add_argument("--start-method", default="auto", choices=("auto", "fork", "spawn"),
                    help="how the ranks start (auto: fork unless this process has a process group)")
    args = ap.parse_args(argv)
    s = setup(NAME, args, PRESETS, REPS)
    log = logger(s)
    key = args.shape or ("smoke" if s.preset == "smoke" else "cpu")
    shape = dict(SHAPES[key]) if key in SHAPES else dict(zip(("hidden", "experts", "top_k", "inter"),
                                                             (int(v) for v in key.split(","))))
    comm_sums, comm_rows = accountant_rows()
    results, timed = [], s.device.type == "cpu"
    threads = max(1, (s.threads if str(args.threads) != "auto" else available_cores()) // args.ranks)
    if not timed:
        log("the timed part runs on CPU / gloo only (2 ranks on one machine); --device cuda: accountant rows only")
    else:
        job = {"shape": shape, "sizes": s.sizes, "reps": s.reps, "warmup": s.warmup, "seed": s.seed,
               "dtype": str(s.dtype).replace("torch.", ""), "threads": threads, "timeout_s": 600}
        log(f"{args.ranks} gloo ranks x {threads} thread(s); hidden {shape['hidden']}, {shape['experts']} experts, "
            f"top-{shape['top_k']}, expert width {shape['inter']}; tokens per rank {s.sizes}")
        for per_rank in launch(job, args.ranks, args.start_method):
            r = summarise(per_rank)
            results.append(r)
            log(f"T={r['tokens_per_rank']}/rank: EP/DP {fmt_ratio(r['ep_over_dp'])}, exchanges "
                f"{r['exchange_share_of_ep']['median']:.0%} of EP")

    def report():
        rows = []
        for r in results:
            sec, sh = r["seconds"], r["exchange_share_of_ep"]
            sent = sum(p["rows_sent"] for p in r["per_rank"]) / sum(p["assignments"] for p in r["per_rank"])
            rows.append([f"{r['tokens_per_rank']:,}", fmt_median_iqr(sec["dp"]), fmt_median_iqr(sec["ep"]),
                         fmt_ratio(r["ep_over_dp"]), fmt_median_iqr(sec["ep_exchanges"]),
                         f"{sh['median']:.0%} [{sh['q1']:.0%}-{sh['q3']:.0%}]", f"{sent:.0%}",
                         f"{max(max(p['max_abs_diff'].values()) for p in r['per_rank']):.1e}"])
        table = md_table(["tokens/rank", "DP: full layer [IQR]", "EP: sharded [IQR]", "EP / DP [IQR]",
                          "exchanges alone [IQR]", "exchanges / EP", "assignments sent away", "max abs diff EP vs DP"],
                         rows)
        p = PAPER_STEP
        title = (f"COMPUTED (vlm.flops.comm), EP = {p['ep']} on {p['world']} GPUs, {p['tokens']} "
                 f"tokens/GPU/step, bf16, ZeRO-{p['zero_stage']}")
        comm = md_table([title, *comm_sums], comm_rows)
        md = (f"## Expert parallelism: {args.ranks} gloo ranks, sharded experts (EP) vs the full layer per rank "
              f"(DP), one MoE layer forward + backward, hidden {shape['hidden']}, {shape['experts']} experts, "
              f"top-{shape['top_k']}, expert width {shape['inter']}\n\n"
              f"{settings_line(s, f'{args.ranks} ranks x {threads} thread(s); a round = the slower rank')}\n\n"
              "- DP = `MoEFeedForward` with every expert on each rank's own tokens; EP = `ExpertParallelMoE` "
              f"(E/{args.ranks} experts per rank; counts exchange, host sync, dispatch all-to-all, grouped SwiGLU, "
              "combine all-to-all); exchanges alone = the same all-to-alls (2 forward, 2 backward) + counts + host "
              "sync, same sizes, replayed in the same rounds\n"
              "- CPU: no network, gloo's all-to-all is a memory copy between processes: this is the dispatch "
              "overhead, not an interconnect. Gradient reduction (DP: every expert's) is not timed\n\n"
              + (table if results else "(not timed on this device)") +
              "\n\nAll-to-all bytes and expert memory for the paper-size presets: computed by the accountant, "
              "NOT measured (balanced routing; the concept layers see tokens / R at their own top-k; bf16 "
              "weights + grads, fp32 master + Adam m, v; expert ZeRO state over world / ep ranks):\n\n" + comm + "\n")
        return {"shape": shape, "ranks": args.ranks, "threads_per_rank": threads, "results": results,
                "accountant": {"step": PAPER_STEP, "presets": comm_sums}}, md

    def plot(plt):
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, r in enumerate(results):
            ax.boxplot([[e / d for e, d in zip(r["round_times"]["ep"], r["round_times"]["dp"])]], positions=[i],
                       widths=0.5)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(results)), [f"{r['tokens_per_rank']} tok/rank" for r in results])
        ax.set(ylabel="EP time / DP time (per round)", title=f"MoE layer fwd+bwd, EP={args.ranks} vs DP (CPU, gloo)")
        return fig

    from benchmarks.report import finish
    return finish(s, report, plot, log)


if __name__ == "__main__":
    run()
