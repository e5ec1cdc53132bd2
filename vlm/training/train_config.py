"""The training config: a YAML file (``configs/train/*.yaml``) + dotted ``key=value`` overrides.

Layout (every key optional; see ``configs/train/default.yaml`` for a full example)::

    base: default.yaml          # inherit another train YAML (path relative to this file), deep-merged
    name: train-vlm             # run folder = <output_dir>/<name>
    output_dir: runs
    seed: 0
    deepspeed: zero2            # zero1 | zero2 | zero3 (configs/deepspeed/<x>.json) or a JSON path
    deepspeed_overrides: {}     # merged into that JSON (free-form DeepSpeed keys)
    precision: auto             # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    device: auto                # auto | cpu | cuda
    cpu_threads: null           # torch threads per CPU process (null: OMP_NUM_THREADS, else cores / local ranks)
    dist_timeout_s: 1800        # collective timeout: a dead or stuck rank ends the run with a clear error
    model: {kind: vlm, preset: configs/model/vlm_tiny.yaml, tokenizer: data/default/tokenizer,
            init_from: null, <any model-config key>: value}           # e.g. num_experts: 16, vision: {backbone: small-vit}
    data:  {kind: mixture, config: configs/data/default.yaml, <build_loader keys>}
    train: {stage, max_steps, micro_batch_size, grad_accum, lr, ..., lr_mult: {...}, freeze: {...}}
    log:   {every_steps, progress_bar, tensorboard, jsonl, peak_flops, visualize_every}
    checkpoint: {every_steps, keep_last, dir, save_final, export_hf}
    eval:  {vqa_json, image_root, limit, batch_size, max_new_tokens, every_steps, periodic_limit}

Overrides use the same dotted names: ``train.lr=1e-3``, ``data.max_length=256``,
``model.num_experts=16``, ``model.vision.backbone=small-vit``, ``deepspeed=zero3``. Values are parsed
as YAML (``1e-3`` -> float, ``true`` -> bool, ``[1, 2]`` -> list). An unknown key or a value of the
wrong type raises ``ConfigError`` whose message is ONE line naming the key. Keys inside ``model``
other than ``kind/preset/tokenizer/init_from`` are handed to the model config (which names a bad one the same
way); ``deepspeed_overrides`` is checked by DeepSpeed itself.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from vlm.config import ConfigError

PARTS = ("vision", "projector", "chunker", "lm")
STAGES = ("align", "finetune", "full")
ZERO_PRESETS = ("zero1", "zero2", "zero3")
REPO_ROOT = Path(__file__).resolve().parents[2]


def _err(key: str, msg: str) -> ConfigError:
    return ConfigError(f"config error: {key}: {msg}")


# --- sections ----------------------------------------------------------------------------------
# Field metadata: "type" = the accepted type(s) when the default is None; "section" = nested
# dataclass; "choices" = allowed values.

def _opt(tp, default=None, **meta):
    return field(default=default, metadata={"type": tp, **meta})


def _choice(default, *choices):
    return field(default=default, metadata={"choices": choices})


@dataclass
class PartFloats:
    """One number per model part (LR multipliers)."""
    vision: float = 1.0
    projector: float = 1.0
    chunker: float = 1.0
    lm: float = 1.0


@dataclass
class PartFlags:
    """Freeze flags per part; null = the stage's default (see ``optim.STAGE_TRAINABLE``)."""
    vision: bool | None = _opt(bool)
    projector: bool | None = _opt(bool)
    chunker: bool | None = _opt(bool)
    lm: bool | None = _opt(bool)


@dataclass
class ModelSection:
    kind: str = _choice("vlm", "vlm", "lm")
    preset: str = "configs/model/vlm_tiny.yaml"
    tokenizer: str | None = _opt(str)  # HF tokenizer folder: sets vocab size and special-token ids
    init_from: str | None = _opt(str)  # an HF export (save_pretrained folder): start from its weights
    overrides: dict = field(default_factory=dict)  # every other key of the section (dotted)


DATA_LOADER_KEYS = ("root", "max_length", "packing", "padding_side", "pad_to_max_length",
                    "max_bad_fraction", "min_samples_for_bad_check", "block_size", "shuffle",
                    "num_samples", "datasets")


@dataclass
class DataSection:
    kind: str = _choice("mixture", "mixture", "synthetic")
    config: str | None = _opt(str)  # a data YAML (configs/data/*.yaml); keys below override it
    num_workers: int = 0
    # data_pipelines.mixture.build_loader keys (None = the data YAML's value or the loader default)
    root: str | None = _opt(str)
    max_length: int | None = _opt(int)
    packing: bool | None = _opt(bool)
    padding_side: str | None = _opt(str)
    pad_to_max_length: bool | None = _opt(bool)
    max_bad_fraction: float | None = _opt(float)
    min_samples_for_bad_check: int | None = _opt(int)
    block_size: int | None = _opt(int)
    shuffle: bool | None = _opt(bool)
    num_samples: int | None = _opt(int)
    datasets: list | None = _opt(list)
    # synthetic data (tests, smoke runs): learnable integer sequences, one image per row for a VLM
    synthetic_vocab: int = 64


@dataclass
class TrainSection:
    stage: str = _choice("full", *STAGES)
    max_steps: int = 100  # optimizer steps; the LR schedule spans exactly these
    stop_at_step: int | None = _opt(int)  # stop early (after checkpointing) without changing the schedule
    micro_batch_size: int = 8  # samples per micro-batch per rank (packed into <= that many rows)
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine floor, as a fraction of the peak LR
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0  # DeepSpeed gradient_clipping (0 = off)
    lr_mult: PartFloats = field(default_factory=PartFloats, metadata={"section": PartFloats})
    freeze: PartFlags = field(default_factory=PartFlags, metadata={"section": PartFlags})
    max_nonfinite_in_row: int = 5  # this many skipped (non-finite) steps in a row abort the run
    fault_nonfinite_steps: list = field(default_factory=list)  # test hook: these steps get a NaN loss


@dataclass
class LogSection:
    every_steps: int = 10
    progress_bar: bool = True
    tensorboard: bool = True
    jsonl: bool = True
    peak_flops: float | None = _opt(float)  # per device; None = a guess from the device (see metrics)
    visualize_every: int = 0  # boundary picture via vlm.visualize every N steps (0 = never)


@dataclass
class CheckpointSection:
    every_steps: int = 0  # 0 = only at the end
    keep_last: int = 2
    dir: str | None = _opt(str)  # default <run>/ckpt
    save_final: bool = True
    export_hf: bool = True  # <run>/hf: model.save_pretrained + processor.save_pretrained


@dataclass
class EvalSection:
    vqa_json: str | None = _opt(str)  # held-out digits VQA split; None = no eval at the end
    image_root: str | None = _opt(str)
    limit: int = 300
    batch_size: int = 64
    max_new_tokens: int = 4
    every_steps: int = 0  # also score during training (rank 0, live weights, ZeRO-1/2) every N steps
    periodic_limit: int = 100  # questions per periodic score


@dataclass
class TrainConfig:
    name: str = "run"
    output_dir: str = "runs"
    seed: int = 0
    deepspeed: str = "zero2"
    deepspeed_overrides: dict = field(default_factory=dict)
    precision: str = _choice("auto", "auto", "fp32", "bf16")
    device: str = _choice("auto", "auto", "cpu", "cuda")
    cpu_threads: int | None = _opt(int)  # torch threads per process on CPU; null = OMP_NUM_THREADS or cores / local ranks
    dist_timeout_s: int = 1800  # a collective waiting longer than this (a dead or stuck rank) ends the run with a clear error
    model: ModelSection = field(default_factory=ModelSection, metadata={"section": ModelSection})
    data: DataSection = field(default_factory=DataSection, metadata={"section": DataSection})
    train: TrainSection = field(default_factory=TrainSection, metadata={"section": TrainSection})
    log: LogSection = field(default_factory=LogSection, metadata={"section": LogSection})
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection,
                                          metadata={"section": CheckpointSection})
    eval: EvalSection = field(default_factory=EvalSection, metadata={"section": EvalSection})
    source: str | None = None  # the YAML it came from (informational)

    # derived -----------------------------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    @property
    def ckpt_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_dir / "ckpt"

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        over = out["model"].pop("overrides")
        out["model"].update(_unflatten(over))
        return out

    def validate(self) -> None:
        t = self.train
        for key, val, lo in (("train.max_steps", t.max_steps, 1), ("train.micro_batch_size", t.micro_batch_size, 1),
                             ("train.grad_accum", t.grad_accum, 1), ("train.max_nonfinite_in_row", t.max_nonfinite_in_row, 1),
                             ("train.warmup_steps", t.warmup_steps, 0), ("log.every_steps", self.log.every_steps, 1),
                             ("checkpoint.every_steps", self.checkpoint.every_steps, 0),
                             ("checkpoint.keep_last", self.checkpoint.keep_last, 1), ("eval.limit", self.eval.limit, 0),
                             ("eval.batch_size", self.eval.batch_size, 1), ("data.num_workers", self.data.num_workers, 0),
                             ("log.visualize_every", self.log.visualize_every, 0),
                             ("eval.every_steps", self.eval.every_steps, 0), ("eval.periodic_limit", self.eval.periodic_limit, 1),
                             ("eval.max_new_tokens", self.eval.max_new_tokens, 1)):
            if val < lo:
                raise _err(key, f"must be >= {lo}, got {val}")
        # optional counts of the data loader (null = the data YAML's value or the loader default)
        for key, val, lo in (("data.max_length", self.data.max_length, 2), ("data.block_size", self.data.block_size, 1),
                             ("data.min_samples_for_bad_check", self.data.min_samples_for_bad_check, 0),
                             ("data.num_samples", self.data.num_samples, 1)):
            if val is not None and val < lo:
                raise _err(key, f"must be >= {lo} (or null), got {val}")
        _number("train.lr", t.lr, 0, strict=True)
        _number("train.min_lr_ratio", t.min_lr_ratio, 0, high=1)
        _number("train.weight_decay", t.weight_decay, 0)
        _number("train.grad_clip", t.grad_clip, 0)
        _number("train.eps", t.eps, 0, strict=True)
        if len(t.betas) != 2 or not all(_finite(b) and 0 <= b < 1 for b in t.betas):
            raise _err("train.betas", f"must be two numbers in [0, 1), got {t.betas}")
        if t.stop_at_step is not None and not 1 <= t.stop_at_step <= t.max_steps:
            raise _err("train.stop_at_step", f"must lie in [1, train.max_steps={t.max_steps}], got {t.stop_at_step}")
        for part in PARTS:
            _number(f"train.lr_mult.{part}", getattr(t.lr_mult, part), 0)
        if not all(_type_ok(s, int) and s >= 0 for s in t.fault_nonfinite_steps):
            raise _err("train.fault_nonfinite_steps", f"must be a list of step numbers >= 0, got {t.fault_nonfinite_steps!r}")
        if self.data.max_bad_fraction is not None:
            _number("data.max_bad_fraction", self.data.max_bad_fraction, 0, high=1)
        if self.log.peak_flops is not None:
            _number("log.peak_flops", self.log.peak_flops, 0, strict=True)
        if not 0 <= self.seed < 2**32:
            raise _err("seed", f"must lie in [0, 2**32), got {self.seed}")
        if not self.name or self.name in (".", "..") or "/" in self.name or "\\" in self.name:
            raise _err("name", f"must be a plain folder name (no '/', not '.' or '..'), got {self.name!r}")
        for key, val in (("output_dir", self.output_dir), ("model.preset", self.model.preset),
                         ("model.tokenizer", self.model.tokenizer), ("model.init_from", self.model.init_from),
                         ("data.config", self.data.config), ("data.root", self.data.root),
                         ("checkpoint.dir", self.checkpoint.dir), ("eval.vqa_json", self.eval.vqa_json),
                         ("eval.image_root", self.eval.image_root)):
            if val is not None and not val.strip():
                raise _err(key, "must be a path (or null), got an empty string")
        if self.data.datasets is not None:
            _check_datasets(self.data.datasets)
        if self.model.kind == "lm" and t.stage == "align":
            raise _err("train.stage", "'align' trains the projector and needs model.kind: vlm")
        if self.deepspeed not in ZERO_PRESETS and not Path(self.deepspeed).is_file():
            raise _err("deepspeed", f"must be one of {list(ZERO_PRESETS)} or a JSON file, got {self.deepspeed!r}")
        if self.data.kind == "mixture" and not (self.data.config or self.data.datasets):
            raise _err("data.config", "a mixture needs data.config (a data YAML) or data.datasets")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise _err("cpu_threads", "must be >= 1 (or null)")
        if self.dist_timeout_s < 1:
            raise _err("dist_timeout_s", f"must be >= 1 second, got {self.dist_timeout_s}")
        if self.data.synthetic_vocab < 8:
            raise _err("data.synthetic_vocab", "must be >= 8")
        if self.data.padding_side not in (None, "right", "left"):
            raise _err("data.padding_side", f"must be 'right' or 'left', got {self.data.padding_side!r}")

    def deepspeed_json(self) -> Path:
        if self.deepspeed in ZERO_PRESETS:
            return REPO_ROOT / "configs" / "deepspeed" / f"{self.deepspeed}.json"
        return Path(self.deepspeed)


def _finite(value) -> bool:
    """A real number (not a bool) that is not NaN or +-inf."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _number(key: str, value, low: float, strict: bool = False, high: float | None = None) -> None:
    """``value`` is finite, >= low (> low when strict) and <= high when given."""
    ok = _finite(value) and (value > low if strict else value >= low) and (high is None or value <= high)
    if not ok:
        bound = f"> {low}" if strict else f">= {low}"
        if high is not None:
            bound += f" and <= {high}"
        raise _err(key, f"must be a finite number {bound}, got {value!r}")


DATASET_TYPES = ("llava_json", "text")  # data_pipelines.mixture.DATASET_TYPES (not imported: torch)
DATASET_KEYS = ("name", "type", "path", "image_root", "weight", "max_image_pixels")


def _check_datasets(datasets: list) -> None:
    """data.datasets entries as data_pipelines.mixture.build_sources reads them."""
    if not datasets:
        raise _err("data.datasets", "must list at least one dataset (or be null)")
    for i, entry in enumerate(datasets):
        key = f"data.datasets[{i}]"
        if not isinstance(entry, dict):
            raise _err(key, f"must be a mapping with type and path, got {entry!r}")
        for k in entry:
            if k not in DATASET_KEYS:
                raise _err(f"{key}.{k}", f"unknown config key (known here: {', '.join(DATASET_KEYS)})")
        if entry.get("type") not in DATASET_TYPES:
            raise _err(f"{key}.type", f"must be one of {list(DATASET_TYPES)}, got {entry.get('type')!r}")
        for k in ("path", "image_root", "name"):
            val = entry.get(k)
            if (k == "path" or val is not None) and (not isinstance(val, str) or not val.strip()):
                raise _err(f"{key}.{k}", f"must be a non-empty string, got {val!r}")
        if "weight" in entry:
            _number(f"{key}.weight", entry["weight"], 0)
        if "max_image_pixels" in entry and not (_type_ok(entry["max_image_pixels"], int) and entry["max_image_pixels"] >= 1):
            raise _err(f"{key}.max_image_pixels", f"must be an integer >= 1, got {entry['max_image_pixels']!r}")


# --- parsing -----------------------------------------------------------------------------------
def _type_ok(value: Any, tp) -> bool:
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, tp)


def _expected(default, f) -> type | None:
    if "type" in f.metadata:
        return f.metadata["type"]
    if default is None:
        return None
    return type(default)


def _build(cls, raw: Any, prefix: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise _err(prefix.rstrip(".") or "config", f"must be a mapping, got {raw!r}")
    known = {f.name: f for f in fields(cls)}
    if cls is ModelSection:  # every key but kind/preset/tokenizer is a model-config override
        raw = dict(raw)
        over = {k: raw.pop(k) for k in list(raw) if k not in ("kind", "preset", "tokenizer", "init_from")}
        raw["overrides"] = _flatten(over)
    kwargs = {}
    for key, val in raw.items():
        name = f"{prefix}{key}"
        if key not in known or key == "source":
            hint = ", ".join(sorted(k for k in known if k not in ("source", "overrides")))
            raise _err(name, f"unknown config key (known here: {hint})")
        f = known[key]
        if "section" in f.metadata:
            kwargs[key] = _build(f.metadata["section"], val, f"{name}.")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if val is None:
            if default is not None and "type" not in f.metadata:
                raise _err(name, "must not be null")
            kwargs[key] = None
            continue
        tp = _expected(default, f)
        if tp is float and isinstance(val, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                val = float(val)
            except ValueError:
                pass
        if tp is not None and not _type_ok(val, tp):
            raise _err(name, f"must be of type {tp.__name__}, got {val!r}")
        if tp is float:
            try:
                val = float(val)
            except OverflowError:
                raise _err(name, f"number out of range, got {val!r}") from None
        if "choices" in f.metadata and val not in f.metadata["choices"]:
            raise _err(name, f"must be one of {list(f.metadata['choices'])}, got {val!r}")
        kwargs[key] = val
    return cls(**kwargs)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _unflatten(d: dict) -> dict:
    out: dict = {}
    for k, v in d.items():
        cur = out
        parts = k.split(".")
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
        cur[parts[-1]] = v
    return out


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text or text.startswith("="):
        raise ConfigError(f"config error: override {text!r} must look like dotted.key=value")
    key, val = text.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(val)
    except yaml.YAMLError:
        raise _err(key.strip(), f"cannot parse value {val!r}") from None


def set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    cur = raw
    for i, p in enumerate(parts[:-1]):
        nxt = cur.get(p)
        if nxt is None:
            nxt = cur[p] = {}
        if not isinstance(nxt, dict):
            raise _err(".".join(parts[: i + 1]), f"is a value, not a section (cannot set {key})")
        cur = nxt
    cur[parts[-1]] = value


def read_yaml(path: str | Path, _seen: tuple = ()) -> dict:
    """Read a train YAML, resolving ``base:`` (relative to the file) recursively."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config error: file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config error: {path} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config error: {path} must hold a mapping at top level")
    base = raw.pop("base", None)
    if base:
        base_path = Path(base) if Path(base).is_absolute() else path.parent / base
        if base_path.resolve() in _seen:
            raise _err("base", f"circular base: {base_path}")
        raw = deep_merge(read_yaml(base_path, _seen + (path.resolve(),)), raw)
    return raw


def load_train_config(path: str | Path | None = None, overrides: list[str] | dict | None = None,
                      raw: dict | None = None) -> TrainConfig:
    """YAML file (or a raw dict) + overrides (``["train.lr=1e-3", ...]`` or a dict) -> TrainConfig."""
    data = deep_merge(read_yaml(path), raw or {}) if path is not None else copy.deepcopy(raw or {})
    items = overrides.items() if isinstance(overrides, dict) else map(parse_override, overrides or [])
    for key, val in items:
        set_dotted(data, key, val)
    cfg = _build(TrainConfig, data, "")
    cfg.source = os.fspath(path) if path is not None else None
    cfg.validate()
    return cfg
