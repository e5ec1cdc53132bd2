"""Solve a ConceptMoE config that matches a plain-MoE baseline (paper section 7): total parameters
within 1% and activated forward FLOPs per token (attention map excluded) within 3%, by strategy
``topk`` (1), ``loop`` (2) or ``wide`` (3); ``solve_match`` documents the rules."""
from __future__ import annotations

import math
import textwrap
from pathlib import Path

import yaml

from vlm.modeling.configuration_conceptmoe import ChunkingConfig, ConceptMoEConfig, LayoutConfig
from vlm.modeling.configuration_conceptmoe import SECTIONS
from vlm.flops.accountant import Arch, count_params, flops_per_token

TIGHT = (0.005, 0.015)  # params, FLOPs: preferred
HARD = (0.01, 0.03)  # required by the project


def _params(a: Arch) -> float:
    return count_params(a)["total"]


def _flops(a: Arch, seq_len: int) -> float:
    return flops_per_token(a, seq_len)["total_no_attn_map"]


def _rel(x: float, ref: float) -> float:
    return abs(x / ref - 1.0)


def _best_kc(a: Arch, target: float, seq_len: int) -> tuple[int, float]:
    """Integer concept top-k whose FLOPs are closest to ``target`` (FLOPs are linear in k_c)."""
    f1, f2 = _flops(a.with_(k_c=1), seq_len), _flops(a.with_(k_c=2), seq_len)
    slope = f2 - f1
    exact = 1 + (target - f1) / slope if slope else 1
    best = None
    for kc in {math.floor(exact), math.ceil(exact)}:
        kc = min(max(kc, 1), a.E)
        err = _rel(f1 + (kc - 1) * slope, target)
        if best is None or err < best[1]:
            best = (kc, err)
    return best


def _middle(n: int, L_C: int) -> tuple:
    start = (L_C - n) // 2
    return tuple(range(start, start + n))


def _tier(c: dict) -> int:
    """0: within the preferred tolerances, 1: within the required ones, 2: outside."""
    for i, (ptol, ftol) in enumerate((TIGHT, HARD)):
        if c["p_err"] <= ptol and c["f_err"] <= ftol:
            return i
    return 2


def _choose(cands: list, pref) -> dict:
    """Among candidates within the required tolerances, the smallest ``pref(c, tier)``; else the
    closest candidate (largest normalised error smallest), marked MISSED."""
    ok = [c for c in cands if _tier(c) <= 1]
    if ok:
        best = min(ok, key=lambda c: pref(c, _tier(c)))
        best["tier"] = ("tight", "hard")[_tier(best)]
        return best
    best = min(cands, key=lambda c: max(c["p_err"] / HARD[0], c["f_err"] / HARD[1]))
    best["tier"] = "MISSED"
    return best


def solve_match(baseline_cfg, strategy: str, ratio: float = 2.0, *, encoder_layers: int | None = None,
                decoder_layers: int | None = None, joint_decoding_layers: int = 4, seq_len: int = 4096,
                loop_layers=None, loop_times: int = 2, width_factor: float | None = None,
                dc_multiple: int | None = None, max_expert_cut: float = 0.25, concept_merge: str | None = None,
                **overrides) -> ConceptMoEConfig:
    """Return a ConceptMoE config (chunking on, target_ratio = ratio) matched to the baseline.

    ``overrides`` are further config fields for the result (e.g. ``boundary_noise_tau=6.0``).
    The chosen candidate's errors are in ``cfg.solver_info`` (not saved with the config).

    Matching targets: total parameters within 1% and activated forward FLOPs per token, attention map
    EXCLUDED, within 3% (both at the target ratio R, M = N / R). Only candidates within those limits
    are eligible; among them the strategy's preference (below) decides, with "also within 0.5% /
    1.5%" as a tie-break after the structural choices. If nothing fits, the closest candidate is
    returned and ``solve_report`` says so.

    What every strategy keeps from the baseline: L, d, heads, head_dim, vocab, expert width
    (``moe_intermediate_size``), shared/dense FFNs, the baseline top_k in the encoder and decoder.
    The layer split (L_E, L_D) is an input (default 1/1 below 16 layers, the paper's 4/4 from 16 on).

    Parameter surplus. Chunking adds the chunker (2 d^2) and K joint-decoding layers (each
    d * (heads + 2 kv_heads) * head_dim); a wider concept model adds d <-> d_c projections. The
    solver compensates only with knobs that keep every layer identical in shape to the baseline:
      - K (joint-decoding layers, from the requested K = min(joint_decoding_layers, L_D) down to 0),
      - the number of routed experts E (global: every MoE layer loses the same experts).
    The expert width is never changed (that would change every layer, including the token layers).
    Preference among candidates that meet the tolerances: strategy-specific key first (below), then
    the largest K (joint decoding helps quality: paper ablation 36.4 vs 35.1), then the fewest experts
    removed, then the tighter tier, then the smallest combined error. At small sizes the surplus is
    < 1% and nothing is cut.

    Strategies (``solve_match(baseline, strategy, ratio, **opts)``):
      topk  (1) same experts; ``concept_top_k`` raised so FLOPs match. FLOPs are linear in k_c, the
            best integer is taken around the exact solution.
      loop  (2) n concept layers (the middle ones) run ``loop_times`` (default 2) times with shared
            weights (no new parameters), plus k_c solved as in (1). n defaults to the candidate closest
            to half the concept layers among those that meet the tolerances (``loop_layers=n`` or a
            list of indices fixes it).
      wide  (3) d_c ~ sqrt(R) * d (the paper's "wider (sqrt(R))" row: per concept the attention and
            expert cost grow by ~sqrt(R), so per token the concept model keeps ~1/sqrt(R) of its
            cost and the KV cache of a concept layer shrinks by sqrt(R)); ``width_factor`` overrides.
            d_c lies in [0.8, 1.25] x the target and is preferably a multiple of 8 * heads (head_dim_c
            a multiple of 8 for fused attention kernels); a multiple of 2 * heads is taken only when it
            reaches a better tolerance tier (``dc_multiple`` forces a step). E is solved from the
            parameter budget (the wider concept experts cost more, so E drops globally), then k_c
            from the FLOP budget. Preference: the
            tighter tier FIRST (d_c, E and k_c together give enough choices to land close), then a
            d_c multiple of 8 * heads, then d_c closest to the target, then K.
    """
    if strategy not in ("topk", "loop", "wide"):
        raise ValueError(f"strategy must be topk, loop or wide, got {strategy!r}")
    base = Arch.of(baseline_cfg)
    if base.chunking:
        raise ValueError("solve_match needs a baseline with chunking off")
    L_E = encoder_layers or (4 if base.L >= 16 else 1)
    L_D = decoder_layers or (4 if base.L >= 16 else 1)
    if base.L - L_E - L_D < 1:
        raise ValueError(f"{base.L} layers leave no concept layer with L_E={L_E}, L_D={L_D}")
    P0, F0 = _params(base), _flops(base, seq_len)
    c0 = base.with_(chunking=True, L_E=L_E, L_D=L_D, R=float(ratio), joint=joint_decoding_layers)
    L_C, K_max = c0.n_con, min(joint_decoding_layers, L_D)
    E_min = max(base.k, math.ceil(base.E * (1 - max_expert_cut)))

    def finish(a: Arch, p_err=None) -> dict:
        p_err = _rel(_params(a), P0) if p_err is None else p_err
        kc, f_err = _best_kc(a, F0, seq_len)
        return {"arch": a.with_(k_c=kc), "p_err": p_err, "f_err": f_err}

    cands, closest = [], math.inf
    if strategy in ("topk", "loop"):
        if strategy == "topk":
            loops = [()]
        elif loop_layers is not None and not isinstance(loop_layers, int):
            loops = [tuple(loop_layers)]
        else:
            loops = [_middle(n, L_C) for n in ([loop_layers] if isinstance(loop_layers, int) else range(1, L_C + 1))]
        for K in range(K_max, -1, -1):
            for E in range(base.E, E_min - 1, -1):
                a = c0.with_(joint=K, E=E)
                p_err = _rel(_params(a), P0)
                closest = min(closest, p_err)
                if p_err > HARD[0] * 3:
                    continue
                for lp in loops:
                    cands.append(finish(a.with_(loop_layers=lp, loop_times=loop_times if lp else 1), p_err))
        n_target = L_C / 2 if not isinstance(loop_layers, int) else loop_layers
        pref = lambda c, t: (abs(len(c["arch"].loop_layers) - n_target), -c["arch"].joint, -c["arch"].E, t,
                             c["p_err"] + c["f_err"])
    else:
        target = (width_factor or math.sqrt(ratio)) * base.d
        coarse = dc_multiple or 8 * base.heads
        step = coarse if dc_multiple else 2 * base.heads  # fine steps only win on a better tier
        lo, hi = math.ceil(0.8 * target / step), math.floor(1.25 * target / step)
        for dc in range(max(lo, 1) * step, hi * step + 1, step):
            if dc == base.d or (base.head_dim is None and (dc // base.heads) % 2):
                continue
            for K in range(K_max, -1, -1):
                a = c0.with_(joint=K, d_c=dc)
                pE, pE1 = _params(a.with_(E=base.E)), _params(a.with_(E=base.E - 1))
                exact = base.E - (P0 - pE) / (pE1 - pE) if pE1 != pE else base.E
                for E in {math.floor(exact), math.ceil(exact)}:
                    if base.k <= E <= base.E:
                        cands.append(finish(a.with_(E=E)))
        pref = lambda c, t: (t, c["arch"].width_c % coarse != 0, abs(c["arch"].width_c - target),
                             -c["arch"].joint, c["p_err"] + c["f_err"])
    if not cands:
        why = (f": the added chunk / joint-decoding weights change the parameter count by at least {closest:.1%} "
               f"(limit {HARD[0] * 3:.0%}), so the model is very small; try --joint-layers 0"
               if closest < math.inf else "")
        raise ValueError(f"no candidate config{why} (or another layer split, or max_expert_cut)")
    best = _choose(cands, pref)
    a = best["arch"]
    fields = _flat(baseline_cfg)
    fields.update(chunking=True, encoder_layers=L_E, decoder_layers=L_D, target_ratio=float(ratio),
                  num_experts=a.E, concept_top_k=a.k_c, joint_decoding_layers=a.joint,
                  concept_loop_layers=list(a.loop_layers), concept_loop_times=a.loop_times if a.loop_layers else 1,
                  concept_hidden_size=a.d_c)
    if concept_merge is not None:
        fields["concept_merge"] = concept_merge
    fields.update(overrides)
    cfg = ConceptMoEConfig(**fields)
    cfg.solver_info = {"strategy": strategy, "param_err": best["p_err"], "flop_err": best["f_err"],
                       "tier": best["tier"], "seq_len": seq_len, "ratio": float(ratio)}
    return cfg


def _flat(cfg) -> dict:
    keys = ConceptMoEConfig.known_keys()
    return {k: getattr(cfg, k) for k in keys if hasattr(cfg, k)}


def solve_report(base_cfg, new_cfg, strategy: str, seq_len: int, ratio: float, baseline_path=None,
                 command: str | None = None) -> str:
    b, n = Arch.of(base_cfg), Arch.of(new_cfg)
    pb, pn = count_params(b)["total"], count_params(n)["total"]
    fb, fn = _flops(b, seq_len), _flops(n, seq_len)
    lines = [f"solved by `{command}`" if command else
             f"solved by `python -m vlm.flops --solve {strategy} --ratio {ratio:g}`"
             + (f" from {baseline_path}" if baseline_path else ""),
             (f"L_E/L_C/L_D = {n.n_enc}/{n.n_con}/{n.n_dec}; experts {b.E} -> {n.E}; top-k {b.k} (token layers), "
             f"concept top-k {n.k_c}; joint-decoding layers K = {n.n_joint}")]
    if n.loop_layers:
        lines.append(f"looped concept layers {list(n.loop_layers)} x{n.loop_times} "
                     f"({len(n.loop_layers) * (n.loop_times - 1)} extra runs, no new parameters)")
    if n.width_c != n.d:
        lines.append(f"concept width d_c = {n.width_c} ({n.width_c / n.d:.3f} x d; sqrt(R) = {math.sqrt(ratio):.3f})")
    lines.append(f"total params {pn / pb - 1:+.3%}, activated FLOPs/token (no attn map, N={seq_len}) "
                 f"{fn / fb - 1:+.3%}")
    tier = getattr(new_cfg, "solver_info", {}).get("tier")
    if tier == "MISSED":
        lines.append("WARNING: no candidate met 1% params / 3% FLOPs; this is the closest one")
    return "\n".join(lines)


# the preset layout comes from the config's own sections (a new field is written without a change here)
_SECTIONS = {sec: tuple(SECTIONS[sec].model_fields) for sec in ("attention", "moe")}
_TOP = tuple(LayoutConfig.model_fields)
_ALWAYS = {"max_position_embeddings", "hidden_size", "num_attention_heads", "num_key_value_heads", "num_experts",
           "top_k", "moe_intermediate_size", "vocab_size", "num_hidden_layers"}
_CHUNK = tuple(f for f in ChunkingConfig.model_fields if f != "chunking")


def config_to_sections(cfg) -> dict:
    """Sectioned dict (the layout of configs/model/*.yaml), default-valued fields omitted."""
    dflt = ConceptMoEConfig()
    keep = lambda k: k in _ALWAYS or getattr(cfg, k) != getattr(dflt, k)
    out = {k: getattr(cfg, k) for k in _TOP if keep(k)}
    for sec, keys in _SECTIONS.items():
        out[sec] = {k: getattr(cfg, k) for k in keys if keep(k)}
    if cfg.chunking:
        ch = {"enabled": True}
        ch.update({k: getattr(cfg, k) for k in _CHUNK
                   if k in ("encoder_layers", "decoder_layers", "target_ratio", "concept_merge", "concept_top_k",
                            "joint_decoding_layers") or keep(k)})
        out["chunking"] = ch
    else:
        out["chunking"] = {"enabled": False}
    return out


def write_yaml(cfg, path, header: str | None = None, notes: str = "") -> None:
    """Write ``cfg`` as a sectioned preset with comment lines on top; it loads with from_yaml."""
    sections = config_to_sections(cfg)
    comment = textwrap.wrap(header, 98) if header else []
    comment += [w for line in notes.splitlines() for w in (textwrap.wrap(line, 98, subsequent_indent="  ")
                                                           if not line.startswith("solved by") else [line])]
    text = "".join(f"# {line}\n" for line in comment)
    for key, val in sections.items():
        if isinstance(val, dict):
            text += f"{key}:\n" + "".join(f"  {k}: {flow_yaml(v)}\n" for k, v in val.items())
        else:
            text += f"{key}: {flow_yaml(val)}\n"
    Path(path).write_text(text)
    ConceptMoEConfig.from_yaml(path)  # refuse to leave an unloadable file behind unnoticed


def flow_yaml(v) -> str:
    return yaml.safe_dump(v, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()
