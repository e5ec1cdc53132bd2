"""The compare YAML (``configs/compare/*.yaml``): typed sections on the project's config mechanism,
and the training YAML shared by every arm."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from vlm.modeling.config_base import ConfigError, NonNegInt, Num, PosInt, Section, Text, check, deep_merge
from vlm.modeling.config_base import apply_overrides, build, load_yaml, read_yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
PRESET_DIR = REPO_ROOT / "configs" / "model" / "compare"  # generated presets, one folder
STRATEGIES = ("topk", "loop", "wide")
SAMPLE_SOLVE = "sample"  # VLM study: concept top-k solved so the LLM FLOPs per sample equal arm match_to's


class CompareError(ConfigError):
    """A compare run that cannot go on (e.g. a stale generated preset); one line."""


def repo_path(p) -> Path:
    p = Path(p)
    return p if p.is_absolute() else REPO_ROOT / p


def rel(p) -> str:
    try:
        return str(Path(p).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(p)


class ArmSpec(Section):
    id: Text
    name: Text
    label: str | None = None  # default: the name
    solve: Literal[(*STRATEGIES, SAMPLE_SOLVE)] | None = None  # null = the baseline (arm a)
    solve_opts: dict = {}
    same_as: str | None = None  # an earlier arm whose language model this arm reuses
    text: dict = {}  # VLM text overrides, e.g. {chunking: {boundary_mode: fixed}}
    projector: dict = {}  # VLM study: projector overrides of this arm, e.g. {merge: avg_pool2x2}
    match_to: str | None = None  # solve "sample": the earlier arm whose LLM FLOPs per sample to match


class MatchSpec(Section):
    """``vlm.flops.matching.solve_match`` options; seq_len: the training row length."""
    ratio: Num(ge=1) = 2.0
    seq_len: PosInt | None = None
    encoder_layers: PosInt | None = None
    decoder_layers: PosInt | None = None
    joint_decoding_layers: NonNegInt = 4
    concept_merge: Literal["last", "sum"] | None = None
    overrides: dict = {}
    text_tokens: PosInt | None = None  # VLM study: text tokens per sample (prompt + answer), for FLOPs per sample


class VLMSpec(Section):
    """Shared by every arm."""
    vision: dict | None = None
    projector: dict | None = None
    text: dict | None = None


class BaselineSpec(Section):
    """Arm a's language model: a preset and/or model-config sections (``lm``)."""
    preset: Text | None = None
    lm: dict = {}


class EvalSpec(Section):
    text: Text | None = "data/default/shakespeare_val.txt"  # null: no held-out text (the VLM study)
    text_max_tokens: PosInt = 8192
    text_seq_len: PosInt | None = None
    text_batch_size: PosInt = 16
    dtype: Literal["float32", "bfloat16"] = "float32"
    keep_hf: bool = True
    prefill_batch: PosInt = 32  # VLM study: held-out prompts per timed prefill (one forward, all arms side by side)
    prefill_reps: PosInt = 5  # timed repetitions per arm (median)
    pictures: NonNegInt = 3  # VLM study: test images drawn with the chunker's concepts (chunking arms)
    image_use: NonNegInt = 64  # VLM study: held-out image records of the image-use measure (0: off; report only)


class CompareConfig(Section):
    name: Text | None = None  # default: the YAML's stem
    study: Literal["lm", "vlm"] = "lm"  # vlm: image-token merges vs chunking (vlm.compare.vlm_report)
    output_dir: Text = "runs/compare"
    seed: NonNegInt = 0
    seeds: PosInt = 1
    jobs: PosInt = 1
    threads: PosInt | None = None
    isolate: bool = False
    preset_prefix: Text | None = None  # default cmp_<name>
    train_base: Text = "configs/train/default.yaml"
    train: dict = {}  # train-YAML keys; model.* is owned by the arms
    # train-YAML keys over ``train`` for a first stage every arm trains before ``train`` (e.g. captions alone, LLaVA's
    # stage 1); the second stage starts from its export (model.init_from). null: one stage
    first_stage: dict | None = None
    vlm: VLMSpec = VLMSpec()
    baseline: BaselineSpec = BaselineSpec()
    match: MatchSpec = MatchSpec()
    arms: Annotated[list[ArmSpec], Field(min_length=1)]
    eval: EvalSpec = EvalSpec()


def load_compare(path, overrides=()) -> dict:
    """The compare YAML + dotted overrides, validated, as a plain dict (``source``: its path)."""
    path = repo_path(path)
    cfg = build(CompareConfig, apply_overrides(load_yaml(path), list(overrides)))
    for key in ((cfg.train or {}).get("model") or {}):
        check(key in ("kind", "tokenizer"), f"train.model.{key}",
              "the arms define the model; only model.tokenizer may be set here")
    for key in ((cfg.first_stage or {}).get("model") or {}):
        check(False, f"first_stage.model.{key}", "the arms define the model in both stages")
    ids: set[str] = set()
    for i, arm in enumerate(cfg.arms):
        check(arm.same_as is None or (arm.same_as in ids and not arm.solve), f"arms[{i}].same_as",
              "must name an EARLIER arm (and the arm must not also solve)")
        ids.add(arm.id)
    check(not (cfg.arms[0].solve or cfg.arms[0].same_as), "arms",
          "the first arm must be the plain-MoE baseline (no solve, no same_as)")
    seen: set[str] = set()
    for i, arm in enumerate(cfg.arms):
        if arm.solve == SAMPLE_SOLVE:
            check(cfg.study == "vlm", f"arms[{i}].solve", "'sample' needs study: vlm")
            check(cfg.match.text_tokens is not None, "match.text_tokens", "is required by solve 'sample'")
        check(not arm.projector or cfg.study == "vlm", f"arms[{i}].projector", "per-arm projectors need study: vlm")
        check(arm.match_to is None or arm.match_to in seen, f"arms[{i}].match_to", "must name an earlier arm")
        seen.add(arm.id)
    check(len({a.name for a in cfg.arms}) == len(cfg.arms), "arms", "arm names must be unique")
    out = cfg.model_dump()
    out["name"] = out["name"] or path.stem
    out["preset_prefix"] = out["preset_prefix"] or f"cmp_{out['name']}"
    for arm in out["arms"]:
        arm["label"] = arm["label"] or arm["name"]
    out["source"] = rel(path)
    return out


def train_raw(cfg: dict) -> dict:
    """The training YAML shared by every arm (``train_base`` deep-merged with ``train``)."""
    return deep_merge(read_yaml(repo_path(cfg["train_base"])), cfg["train"] or {})
