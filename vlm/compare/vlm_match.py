"""The VLM study's compute match: image tokens per image of each arm (its projector merge over the
vision tower's patch grid) and, for the ConceptMoE arms (solve "sample"), the concept top-k that makes
the language model's FLOPs per sample (image + text tokens, concept layers at the per-modality target
R) equal those of a reference arm (``match_to``; the 2x2-merged plain MoE in the presets)."""
from __future__ import annotations

from vlm.flops import count_params, image_tokens_per_image, llm_flops_per_sample
from vlm.flops.matching import config_to_sections
from vlm.modeling.config_base import deep_merge
from vlm.modeling.configuration_conceptmoe import ConceptMoEConfig

SAMPLE_TOL = 0.03  # relative LLM FLOPs per sample, as the per-token match's tolerance


def patch_grid(vision: dict) -> tuple[int, int]:
    """The tower's patch grid, from the architecture built on the meta device (no weights read: the presets and
    the FLOPs match do not need ``vision.pretrained`` to exist yet)."""
    import torch

    from vlm.modeling.vision_base import VisionEncoderConfig
    from vlm.modeling.vision_registry import build_vision_encoder

    with torch.device("meta"):
        return tuple(build_vision_encoder(VisionEncoderConfig(**vision)).patch_grid)


def arm_projector(cfg: dict, arm: dict) -> dict:
    return deep_merge(cfg["vlm"].get("projector") or {}, arm.get("projector") or {})


def image_tokens(cfg: dict, arm: dict, grid: tuple[int, int]) -> int:
    return image_tokens_per_image(arm_projector(cfg, arm), grid)


def sample_flops(lm_cfg, n_image: int, cfg: dict, seq_len: int, image_ratio=None, text_ratio=None) -> dict:
    return llm_flops_per_sample(lm_cfg, n_image, int(cfg["match"]["text_tokens"]), seq_len,
                                image_ratio=image_ratio, text_ratio=text_ratio)


def solve_sample(base, cfg: dict, arm: dict, n_image: int, target: float | None, seq_len: int):
    """The arm's language model: the baseline's layers, with chunking when ``arm.text.chunking`` has
    ``enabled`` or per-modality targets (``match`` layer split), and one free knob: the concept top-k
    of a chunked model, the top-k of a plain one, the integer in [1, E] whose LLM FLOPs per sample are
    closest to ``target``. ``target`` None (the anchor arm, no ``match_to``) keeps the baseline's top-k.
    The config carries ``solver_info`` (knob, value, relative error, within tolerance)."""
    m = cfg["match"]
    arm_chunking = (arm.get("text") or {}).get("chunking") or {}
    chunked = bool(arm_chunking) and arm_chunking.get("enabled", True)
    sections = config_to_sections(base)
    if chunked:
        chunking = {"enabled": True, "target_ratio": float(m.get("ratio") or 2.0),
                    "encoder_layers": m.get("encoder_layers") or 1, "decoder_layers": m.get("decoder_layers") or 1,
                    "joint_decoding_layers": m.get("joint_decoding_layers") or 0}
        if m.get("concept_merge"):
            chunking["concept_merge"] = m["concept_merge"]
        chunking.update(arm_chunking)
        sections = deep_merge(sections, {"chunking": chunking})
    E, k0 = base.num_experts, base.top_k
    if target is None:
        grid = [(k0, k0 if chunked else None)]
    elif chunked:  # concept top-k first; the token layers' top-k rises only where that cannot reach the target
        grid = [(k, kc) for k in range(k0, E + 1) for kc in range(1, E + 1)]
    else:
        grid = [(k, None) for k in range(1, E + 1)]
    best = None
    for k, kc in grid:
        over = {"moe": {"top_k": k}}
        if kc is not None:
            over["chunking"] = {"concept_top_k": kc}
        lm = ConceptMoEConfig.from_dict_sections(deep_merge(sections, over))
        f = sample_flops(lm, n_image, cfg, seq_len)["forward"]
        err = 0.0 if target is None else f / target - 1
        if best is None or abs(err) < abs(best[1]) - 1e-9:
            best = (lm, err, k, kc)
    lm, err, k, kc = best
    knob = f"moe.top_k {k}" + ("" if kc is None else f", chunking.concept_top_k {kc}")
    lm.solver_info = {"strategy": "sample", "knob": knob, "top_k": k, "concept_top_k": kc,
                      "flops_per_sample_rel": err, "within_tolerance": abs(err) <= SAMPLE_TOL,
                      "match_to": arm.get("match_to")}
    return lm


def match_rows(cfg: dict, lm_cfgs: dict, grid: tuple[int, int], seq_len: int, measured: dict) -> list[dict]:
    """One row per arm: LLM params, image tokens per image, target R, FLOPs per sample (train / inference)
    at the target R and at the measured R (``measured``: arm id -> {ratio_image, ratio_text})."""
    rows = []
    ref = {}
    for arm in sorted(cfg["arms"], key=lambda a: a["id"]):
        lm = lm_cfgs[arm["id"]]
        n_img = image_tokens(cfg, arm, grid)
        f = sample_flops(lm, n_img, cfg, seq_len)
        got = measured.get(arm["id"]) or {}
        ri, rt = got.get("ratio_image"), got.get("ratio_text")
        fa = sample_flops(lm, n_img, cfg, seq_len, ri, rt) if lm.chunking and ri and rt else f
        target_r = (f"image {lm.image_target_ratio or lm.target_ratio:g} / text {lm.text_target_ratio or lm.target_ratio:g}"
                    if lm.chunking else "1 (no chunking)")
        row = {"arm": arm["id"], "label": arm["label"], "merge": arm_projector(cfg, arm).get("merge", "none"),
               "image_tokens": n_img, "lm_params": count_params(lm)["total"], "target_R": target_r,
               "top_k": lm.top_k, "concept_top_k": lm.concept_top_k if lm.chunking else None,
               "flops_fwd": f["forward"], "flops_train": f["train"], "flops_fwd_achieved": fa["forward"],
               "ratio_image": ri, "ratio_text": rt, "match_to": arm.get("match_to")}
        ref[arm["id"]] = row
        rows.append(row)
    for row in rows:
        if row["match_to"]:
            row["flops_rel"] = row["flops_fwd"] / ref[row["match_to"]]["flops_fwd"] - 1
            row["match_ok"] = abs(row["flops_rel"]) <= SAMPLE_TOL
    return rows
