"""CLI of the FLOP accountant and matcher: ``python -m vlm.flops --config <model YAML> [--solve ...]``;
``--ep N``: the expert-parallel all-to-all bytes per step and expert memory per GPU (``vlm.flops.comm``)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vlm.modeling.configuration_conceptmoe import ConceptMoEConfig
from vlm.flops.accountant import compare_table, single_table
from vlm.flops.comm import ep_table
from vlm.flops.matching import solve_match, solve_report, write_yaml


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vlm.flops", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="model YAML (configs/model/*.yaml)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--ratio", type=float, default=None,
                    help="R = tokens/concepts (measured); default the config's target_ratio. With --solve: "
                         "the target ratio (default 2)")
    ap.add_argument("--dtype-bytes", type=int, default=2)
    ap.add_argument("--match-to", default=None, help="second model YAML: print both side by side")
    ap.add_argument("--solve", choices=("topk", "loop", "wide"), default=None,
                    help="solve a ConceptMoE matching --config (a plain MoE) by the paper's strategy 1/2/3")
    ap.add_argument("--out", default=None, help="with --solve: write the solved config here")
    ap.add_argument("--encoder-layers", type=int, default=None)
    ap.add_argument("--decoder-layers", type=int, default=None)
    ap.add_argument("--joint-decoding-layers", type=int, default=None)
    ap.add_argument("--loop-layers", type=int, default=None, help="loop: how many concept layers loop")
    ap.add_argument("--loop-times", type=int, default=None)
    ap.add_argument("--concept-merge", default=None)
    ap.add_argument("--header", default=None, help="with --out: first comment line of the YAML")
    ap.add_argument("--ep", type=int, default=None,
                    help="expert-parallel size: print the all-to-all bytes per step and the expert memory per GPU "
                         "(with --match-to: both configs)")
    ap.add_argument("--tokens-per-gpu", type=int, default=8192, help="with --ep: tokens per GPU per step")
    ap.add_argument("--world", type=int, default=None, help="with --ep: GPUs in all (default: --ep)")
    ap.add_argument("--zero-stage", type=int, default=2, choices=(1, 2), help="with --ep: ZeRO stage")
    args = ap.parse_args(argv)
    cfg = ConceptMoEConfig.from_yaml(args.config)
    if args.ep:
        cfgs = {Path(args.config).stem: cfg}
        if args.match_to:
            cfgs[Path(args.match_to).stem] = ConceptMoEConfig.from_yaml(args.match_to)
        print(ep_table(cfgs, args.tokens_per_gpu, args.ep, args.world, args.dtype_bytes, args.zero_stage, args.ratio))
        return 0
    if args.solve:
        opts = {k: v for k, v in (("encoder_layers", args.encoder_layers), ("decoder_layers", args.decoder_layers),
                                  ("joint_decoding_layers", args.joint_decoding_layers),
                                  ("loop_layers", args.loop_layers), ("loop_times", args.loop_times),
                                  ("concept_merge", args.concept_merge)) if v is not None}
        ratio = args.ratio or 2.0
        new = solve_match(cfg, args.solve, ratio, seq_len=args.seq_len, **opts)
        argv_list = list(sys.argv[1:] if argv is None else argv)
        skip = {"--header"}
        shown = [x for i, x in enumerate(argv_list) if x not in skip and (i == 0 or argv_list[i - 1] not in skip)]
        report = solve_report(cfg, new, args.solve, args.seq_len, ratio, baseline_path=args.config,
                              command="python -m vlm.flops " + " ".join(shown))
        print(compare_table(cfg, new, args.seq_len, ratio, args.dtype_bytes, names=("baseline", args.solve)))
        print(report)
        if args.out:
            write_yaml(new, args.out, header=args.header, notes=report)
            print(f"wrote {args.out}")
        return 0
    if args.match_to:
        other = ConceptMoEConfig.from_yaml(args.match_to)
        print(compare_table(cfg, other, args.seq_len, args.ratio, args.dtype_bytes,
                            names=(Path(args.config).stem, Path(args.match_to).stem)))
        return 0
    print(single_table(cfg, args.seq_len, args.ratio, args.dtype_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
