"""The compare YAML (``configs/compare/*.yaml``): loading and checking it, the shared training
YAML of every arm, and the matched language-model / VLM presets of the arms (solved with
``vlm.flop_matching`` against the baseline; see ``vlm/compare.py`` for the whole flow)."""
from __future__ import annotations

from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
PRESET_DIR = REPO_ROOT / "configs" / "model"
STRATEGIES = ("topk", "loop", "wide")
TOP_KEYS = {"name", "output_dir", "seed", "seeds", "jobs", "threads", "isolate", "preset_prefix", "train_base", "train",
            "vlm", "baseline", "match", "arms", "eval"}
ARM_KEYS = {"id", "name", "label", "solve", "solve_opts", "same_as", "text"}
MATCH_KEYS = {"ratio", "seq_len", "encoder_layers", "decoder_layers", "joint_decoding_layers", "concept_merge",
              "overrides"}
EVAL_DEFAULTS = {"text": "data/default/shakespeare_val.txt", "text_max_tokens": 8192, "text_seq_len": None,
                 "text_batch_size": 16, "dtype": "float32", "keep_hf": True}
VLM_KEYS = {"vision", "projector", "text"}


class CompareError(ValueError):
    """A bad compare config; one line."""


def _err(key: str, msg: str) -> CompareError:
    return CompareError(f"compare config error: {key}: {msg}")


def _path(p) -> Path:
    p = Path(p)
    return p if p.is_absolute() else REPO_ROOT / p


def _rel(p: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(p)


# --- config ------------------------------------------------------------------------------------
def load_compare(path, overrides=()) -> dict:
    from vlm.training.train_config import parse_override, set_dotted

    path = _path(path)
    if not path.is_file():
        raise CompareError(f"compare config error: file not found: {path}")
    raw = yaml.safe_load(path.read_text()) or {}
    for text in overrides:
        key, val = parse_override(text)
        set_dotted(raw, key, val)
    for key in raw:
        if key not in TOP_KEYS:
            raise _err(key, f"unknown key (known: {', '.join(sorted(TOP_KEYS))})")
    cfg = {"name": path.stem, "output_dir": "runs/compare", "seed": 0, "seeds": 1, "jobs": 1, "threads": None,
           "isolate": False, "preset_prefix": None, "train_base": "configs/train/default.yaml", "train": {},
           "vlm": {}, "baseline": {}, "match": {}, "arms": [], "eval": {}, **raw, "source": _rel(path)}
    cfg["preset_prefix"] = cfg["preset_prefix"] or f"cmp_{cfg['name']}"
    cfg["eval"] = {**EVAL_DEFAULTS, **(cfg["eval"] or {})}
    for key in cfg["eval"]:
        if key not in EVAL_DEFAULTS:
            raise _err(f"eval.{key}", f"unknown key (known: {', '.join(EVAL_DEFAULTS)})")
    for key in cfg["match"]:
        if key not in MATCH_KEYS:
            raise _err(f"match.{key}", f"unknown key (known: {', '.join(sorted(MATCH_KEYS))})")
    for key in cfg["vlm"]:
        if key not in VLM_KEYS:
            raise _err(f"vlm.{key}", f"unknown key (known: {', '.join(sorted(VLM_KEYS))})")
    model = (cfg["train"] or {}).get("model") or {}
    for key in model:
        if key not in ("kind", "tokenizer"):
            raise _err(f"train.model.{key}", "the arms define the model; only model.tokenizer may be set here")
    for key in ("seeds", "jobs"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise _err(key, f"must be an integer >= 1, got {cfg[key]!r}")
    arms, ids = [], set()
    for i, arm in enumerate(cfg["arms"]):
        for key in arm:
            if key not in ARM_KEYS:
                raise _err(f"arms[{i}].{key}", f"unknown key (known: {', '.join(sorted(ARM_KEYS))})")
        arm = {"label": arm.get("name"), "solve": None, "solve_opts": {}, "same_as": None, "text": {}, **arm}
        if "id" not in arm or "name" not in arm:
            raise _err(f"arms[{i}]", "needs an id and a name")
        if arm["solve"] is not None and arm["solve"] not in STRATEGIES:
            raise _err(f"arms[{i}].solve", f"must be null or one of {STRATEGIES}, got {arm['solve']!r}")
        if arm["same_as"] is not None and (arm["same_as"] not in ids or arm["solve"]):
            raise _err(f"arms[{i}].same_as", "must name an EARLIER arm (and the arm must not also solve)")
        ids.add(arm["id"])
        arms.append(arm)
    if not arms or arms[0]["solve"] or arms[0]["same_as"]:
        raise _err("arms", "the first arm must be the plain-MoE baseline (no solve, no same_as)")
    if len({a["name"] for a in arms}) != len(arms):
        raise _err("arms", "arm names must be unique")
    cfg["arms"] = arms
    return cfg


def train_raw(cfg: dict) -> dict:
    """The training YAML shared by every arm (``train_base`` deep-merged with ``train``)."""
    from vlm.training.train_config import deep_merge, read_yaml

    return deep_merge(read_yaml(_path(cfg["train_base"])), cfg["train"] or {})


def _seq_len(cfg: dict, raw: dict) -> int:
    if cfg["match"].get("seq_len"):
        return int(cfg["match"]["seq_len"])
    data = raw.get("data") or {}
    if data.get("max_length"):
        return int(data["max_length"])
    if data.get("config"):
        return int((yaml.safe_load(_path(data["config"]).read_text()) or {}).get("max_length") or 128)
    return 64


def _tokenizer_vocab(raw: dict) -> int | None:
    tok = (raw.get("model") or {}).get("tokenizer")
    if not tok or not _path(tok).is_dir():
        return None
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(_path(tok))))


# --- presets -----------------------------------------------------------------------------------
def baseline_config(cfg: dict, vocab: int | None):
    from vlm.config import ConceptMoEConfig, load_yaml
    from vlm.training.train_config import deep_merge

    base = cfg["baseline"] or {}
    raw = load_yaml(_path(base["preset"])) if base.get("preset") else {}
    raw = deep_merge(raw, base.get("lm") or {})
    over = {"vocab_size": vocab} if vocab else {}
    lm = ConceptMoEConfig.from_dict_sections(raw, over)
    if lm.chunking:
        raise _err("baseline", "the baseline (arm a) must be a plain MoE (chunking off)")
    return lm


def _vlm_text(cfg: dict, arm: dict, lm_file: str, header: list[str]) -> str:
    from vlm.flop_matching import _dump
    from vlm.training.train_config import deep_merge

    v = cfg["vlm"]
    text = deep_merge(v.get("text") or {}, arm["text"] or {})
    out = "".join(f"# {line}\n" for line in header)
    for key in ("vision", "projector"):
        if v.get(key):
            out += f"{key}: {_dump(v[key])}\n"
    out += f"text_preset: {lm_file}\n"
    if text:
        out += f"text: {_dump(text)}\n"
    return out


def build_presets(cfg: dict, raw: dict, mode: str = "create", preset_dir: Path = PRESET_DIR) -> dict:
    """Solve every arm; return {arm id: {lm_cfg, lm_path, vlm_path, solver_info, text}}.

    ``mode``: "create" writes missing presets and refuses stale ones (a preset that differs from the
    fresh solve), "write" (re)writes every preset that differs, "check" writes nothing and refuses
    missing or stale presets."""
    import tempfile

    from vlm.flop_matching import solve_match, solve_report, write_yaml
    from vlm.flops import describe

    seq_len = _seq_len(cfg, raw)
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
                      f"(vlm.flop_matching, N={seq_len}). Generated, do not edit.")
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
                raise CompareError(f"compare: {_rel(target)} {what} a fresh solve of {cfg['source']} "
                                   f"(config or solver changed?); rerun with --write-presets to rewrite it")
            target.write_text(text)
            print(f"[compare] wrote {_rel(target)}", flush=True)
    for spec in out.values():  # the VLM preset text (part of the job key)
        spec["text"] = spec["vlm_path"].read_text()
    return out
