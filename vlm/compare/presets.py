"""The arms' matched language-model and VLM presets, solved with ``vlm.flops.matching`` against
the baseline and written to ``configs/model/compare/`` (checked against a fresh solve)."""
from __future__ import annotations

from pathlib import Path

from vlm.compare.config import PRESET_DIR, CompareError, rel, repo_path
from vlm.modeling.configuration_conceptmoe import ConceptMoEConfig
from vlm.modeling.config_base import deep_merge, load_yaml
from vlm.flops import describe, solve_match, solve_report, write_yaml
from vlm.flops.matching import flow_yaml


def seq_len_of(cfg: dict, raw: dict) -> int:
    if cfg["match"].get("seq_len"):
        return int(cfg["match"]["seq_len"])
    data = raw.get("data") or {}
    if data.get("max_length"):
        return int(data["max_length"])
    if data.get("config"):
        return int((load_yaml(repo_path(data["config"]))).get("max_length") or 128)
    return 64


def _tokenizer_vocab(raw: dict) -> int | None:
    tok = (raw.get("model") or {}).get("tokenizer")
    if not tok or not repo_path(tok).is_dir():
        return None
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(repo_path(tok))))


# --- presets -----------------------------------------------------------------------------------
def baseline_config(cfg: dict, vocab: int | None):
    base = cfg["baseline"] or {}
    raw = load_yaml(repo_path(base["preset"])) if base.get("preset") else {}
    raw = deep_merge(raw, base.get("lm") or {})
    over = {"vocab_size": vocab} if vocab else {}
    lm = ConceptMoEConfig.from_dict_sections(raw, over)
    if lm.chunking:
        raise CompareError("compare config error: baseline: the baseline (arm a) must be a plain MoE (chunking off)")
    return lm


def _vlm_text(cfg: dict, arm: dict, lm_file: str, header: list[str]) -> str:

    v = cfg["vlm"]
    text = deep_merge(v.get("text") or {}, arm["text"] or {})
    sections = {"vision": v.get("vision"), "projector": deep_merge(v.get("projector") or {}, arm.get("projector") or {})}
    out = "".join(f"# {line}\n" for line in header)
    for key in ("vision", "projector"):
        if sections[key]:
            out += f"{key}: {flow_yaml(sections[key])}\n"
    out += f"text_preset: {lm_file}\n"
    if text:
        out += f"text: {flow_yaml(text)}\n"
    return out


def _solve_sample(cfg: dict, arm: dict, base, out: dict, seq_len: int, cmd: str):
    """Arm ``arm`` of the VLM study: its free top-k solved so that its LLM FLOPs per sample equal arm
    ``match_to``'s (none: the anchor, the baseline's top-k)."""
    from vlm.compare import vlm_match

    grid = vlm_match.patch_grid(cfg["vlm"]["vision"])
    target, ref = None, None
    if arm.get("match_to"):
        ref = next(a for a in cfg["arms"] if a["id"] == arm["match_to"])
        target = vlm_match.sample_flops(out[ref["id"]]["lm_cfg"], vlm_match.image_tokens(cfg, ref, grid), cfg,
                                        seq_len)["forward"]
    lm_cfg = vlm_match.solve_sample(base, cfg, arm, vlm_match.image_tokens(cfg, arm, grid), target, seq_len)
    info = lm_cfg.solver_info
    what = (f"{info['knob']} so that its LLM FLOPs per sample ({cfg['match']['text_tokens']} text "
            f"tokens + its image tokens) equal arm {ref['id']}'s ({info['flops_per_sample_rel']:+.2%})"
            if ref else f"{info['knob']} (the anchor the other arms' FLOPs per sample match)")
    header = (f"arm {arm['id']} ({arm['label']}) of {cfg['source']}: the baseline's layers"
              f"{' with chunking' if lm_cfg.chunking else ''}, {what}. Generated, do not edit.")
    return lm_cfg, info, header, f"vlm.compare.vlm_match.solve_sample; regenerate: `{cmd}`"


def build_presets(cfg: dict, raw: dict, mode: str = "create", preset_dir: Path = PRESET_DIR) -> dict:
    """Solve every arm; return {arm id: {lm_cfg, lm_path, vlm_path, solver_info, text}}.

    ``mode``: "create" writes missing presets and refuses stale ones (a preset that differs from the
    fresh solve), "write" (re)writes every preset that differs, "check" writes nothing and refuses
    missing or stale presets."""
    import tempfile


    seq_len = seq_len_of(cfg, raw)
    vocab = _tokenizer_vocab(raw)
    base = baseline_config(cfg, vocab)
    m = cfg["match"]
    ratio = float(m.get("ratio", 2.0))
    cmd = f"python -m vlm.compare --config {cfg['source']} --write-presets"
    prefix, out, texts = cfg["preset_prefix"], {}, {}
    for arm in cfg["arms"]:
        lm_name = f"{prefix}_{arm['name']}_lm.yaml"
        if arm["same_as"]:
            src = out[arm["same_as"]]
            lm_cfg, lm_name, info = src["lm_cfg"], src["lm_path"].name, src["solver_info"]
        elif arm["solve"] == "sample":
            lm_cfg, info, header, notes = _solve_sample(cfg, arm, base, out, seq_len, cmd)
            texts[lm_name] = (lm_cfg, header, notes)
        elif arm["solve"] is None:
            lm_cfg, info = base, None
            header = (f"{lm_name[:-5]}: arm {arm['id']} ({arm['label']}) of {cfg['source']}: the plain-MoE "
                      f"baseline every other arm is matched to. Generated, do not edit: `{cmd}`.")
            notes = describe(base) + f"; vocab {base.vocab_size} (from the tokenizer)"
            texts[lm_name] = (lm_cfg, header, notes)
        else:
            opts = {"encoder_layers": m.get("encoder_layers"), "decoder_layers": m.get("decoder_layers"),
                    "joint_decoding_layers": m.get("joint_decoding_layers", 4), "seq_len": seq_len,
                    "concept_merge": m.get("concept_merge"), **(m.get("overrides") or {}), **(arm["solve_opts"] or {})}
            lm_cfg = solve_match(base, arm["solve"], ratio, **opts)
            info = lm_cfg.solver_info
            header = (f"{lm_name[:-5]}: arm {arm['id']} ({arm['label']}) of {cfg['source']}: ConceptMoE R={ratio:g} "
                      f"matched to {prefix}_{cfg['arms'][0]['name']}_lm.yaml by strategy {arm['solve']} "
                      f"(vlm.flops.matching, N={seq_len}). Generated, do not edit.")
            notes = solve_report(base, lm_cfg, arm["solve"], seq_len, ratio, command=cmd)
            texts[lm_name] = (lm_cfg, header, notes)
        vlm_name = f"{prefix}_{arm['name']}.yaml"
        vlm_header = [(f"{vlm_name[:-5]}: VLM of arm {arm['id']} ({arm['label']}) of {cfg['source']}; vision tower "
                       "and projector shared by all arms."), f"Generated, do not edit: `{cmd}`."]
        texts[vlm_name] = _vlm_text(cfg, arm, lm_name, vlm_header)
        out[arm["id"]] = {"lm_cfg": lm_cfg, "lm_path": preset_dir / lm_name, "vlm_path": preset_dir / vlm_name,
                          "solver_info": info}
    with tempfile.TemporaryDirectory() as tmp:
        for fname, spec in texts.items():
            if isinstance(spec, tuple):
                write_yaml(spec[0], Path(tmp) / fname, header=spec[1], notes=spec[2])
                text = (Path(tmp) / fname).read_text()
            else:
                text = spec
            target = preset_dir / fname
            if target.is_file() and target.read_text() == text:
                continue
            if mode == "check" or (target.is_file() and mode != "write"):
                what = "differs from" if target.is_file() else "is missing for"
                raise CompareError(f"compare: {rel(target)} {what} a fresh solve of {cfg['source']} "
                                   f"(config or solver changed?); rerun with --write-presets to rewrite it")
            target.write_text(text)
            print(f"[compare] wrote {rel(target)}", flush=True)
    for spec in out.values():  # the VLM preset text (part of the job key)
        spec["text"] = spec["vlm_path"].read_text()
    return out
