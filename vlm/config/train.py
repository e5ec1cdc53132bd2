"""The training config (``configs/train/*.yaml``): typed sections, ``base:`` inheritance, dotted
overrides (``train.lr=1e-3``, ``model.num_experts=16``, ``deepspeed=zero3``).

Keys of ``model`` other than ``kind/preset/llm/tokenizer/init_from`` are model-config overrides, checked
where the model config is built; ``deepspeed_overrides`` is checked by DeepSpeed itself."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, PrivateAttr, model_validator

from vlm.modeling.chat_common import DATASET_TYPES
from vlm.modeling.config_base import NonNegInt, Num, PosInt, Section, Text, apply_overrides, build, check
from vlm.modeling.config_base import deep_merge, flatten, read_yaml, unflatten

PARTS = ("vision", "projector", "chunker", "lm")
STAGES = ("align", "finetune", "full")
ZERO_PRESETS = ("zero1", "zero2", "zero3")
REPORT_TO = ("tensorboard", "wandb", "jsonl")  # log.report_to choices (vlm/training/metrics.py)
REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_KEYS = ("kind", "preset", "llm", "tokenizer", "init_from")
DATA_LOADER_KEYS = ("root", "max_length", "packing", "padding_side", "pad_to_max_length",
                    "max_bad_fraction", "min_samples_for_bad_check", "block_size", "shuffle",
                    "num_samples", "datasets", "index_cache_dir")


def _plain_name(name: str) -> str:
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        raise ValueError("must be a plain folder name (no '/', not '.' or '..')")
    return name


def _unique(values: list) -> list:
    if len(set(values)) != len(values):
        raise ValueError("must not list a value twice")
    return values


def _deepspeed(value: str) -> str:
    if value not in ZERO_PRESETS and not Path(value).is_file():
        raise ValueError(f"must be one of {list(ZERO_PRESETS)} or a JSON file")
    return value


class PartFloats(Section):
    """One number per model part (LR multipliers)."""
    vision: Num(ge=0) = 1.0
    projector: Num(ge=0) = 1.0
    chunker: Num(ge=0) = 1.0
    lm: Num(ge=0) = 1.0


class PartFlags(Section):
    """Freeze flags per part; null = the stage's default (``optim.STAGE_TRAINABLE``)."""
    vision: bool | None = None
    projector: bool | None = None
    chunker: bool | None = None
    lm: bool | None = None


class ModelSection(Section):
    kind: Literal["vlm", "lm"] = "vlm"
    preset: Text | None = "configs/model/vlm_tiny.yaml"  # null: the architecture of init_from's export
    llm: Text | None = None  # pretrained language model: a transformers or ConceptMoE folder (vlm/training/build.py)
    tokenizer: Text | None = None  # HF tokenizer folder: vocab size and special-token ids; null = llm's own
    init_from: Text | None = None  # an HF export (save_pretrained folder): start from its weights
    overrides: dict = {}  # every other key of the section, dotted

    @model_validator(mode="before")
    @classmethod
    def _collect_overrides(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        out = {k: v for k, v in raw.items() if k in MODEL_KEYS}
        out["overrides"] = flatten({k: v for k, v in raw.items() if k not in MODEL_KEYS})
        return out


class DatasetEntry(Section):
    """One ``data.datasets`` entry as ``data_pipelines.sources.build_sources`` reads it."""
    name: Text | None = None
    type: Literal[DATASET_TYPES]
    path: Text
    image_root: Text | None = None
    weight: Num(ge=0) = 1.0
    max_image_pixels: PosInt | None = None
    caption_prompt: Text | None = None  # webdataset: the question of a .txt-caption sample


class DataSection(Section):
    kind: Literal["mixture", "synthetic"] = "mixture"
    config: Text | None = None  # a data YAML (configs/data/*.yaml); keys below override it
    num_workers: NonNegInt = 0
    # data_pipelines.mixture.build_loader keys (None = the data YAML's value or the loader default)
    root: Text | None = None
    max_length: Annotated[int, Field(ge=2)] | None = None
    packing: bool | None = None
    padding_side: Literal["right", "left"] | None = None
    pad_to_max_length: bool | None = None
    max_bad_fraction: Num(ge=0, le=1) | None = None
    min_samples_for_bad_check: NonNegInt | None = None
    block_size: PosInt | None = None
    shuffle: bool | None = None
    num_samples: PosInt | None = None
    index_cache_dir: Text | None = None  # LLaVA record indexes when the data folder is not writable
    datasets: Annotated[list[dict], Field(min_length=1)] | None = None  # entries: DatasetEntry
    synthetic_vocab: Annotated[int, Field(ge=8)] = 64  # synthetic data: learnable integer sequences


class LoraSection(Section):
    """LoRA adapters (peft) on the language model's linear layers (``vlm/training/lora.py``): the lm
    part then trains only its adapters; the other parts follow ``train.stage`` / ``train.freeze``."""
    r: PosInt = 8  # adapter rank
    alpha: Num(gt=0) = 16.0  # scaling = alpha / r
    dropout: Num(ge=0, lt=1) = 0.0  # on the adapter's input, training only
    # leaf names (or dotted tails) of nn.Linear modules of the LM; the MoE experts are not nn.Linear
    target_modules: Annotated[list[Text], Field(min_length=1), AfterValidator(_unique)] = \
        ["q_proj", "k_proj", "v_proj", "o_proj"]


class FusedKernelsSection(Section):
    """Per kernel: auto (the fused one on CUDA where it can run, else the torch path, said in the log),
    torch, or the fused one by name (an error where it cannot run); vlm/modeling/fused_kernels.py."""
    cross_entropy: Literal["auto", "torch", "liger"] = "auto"  # liger's fused linear CE (no logits kept)
    rms_norm: Literal["auto", "torch", "liger"] = "auto"  # liger's RMSNorm kernels
    swiglu: Literal["auto", "torch", "triton"] = "auto"  # our Triton kernels of the experts' activation


class TrainSection(Section):
    stage: Literal[STAGES] = "full"
    max_steps: PosInt = 100  # optimizer steps; the LR schedule spans exactly these
    stop_at_step: PosInt | None = None  # stop early (after checkpointing) without changing the schedule
    micro_batch_size: PosInt = 8  # samples per micro-batch per rank (packed into <= that many rows)
    grad_accum: PosInt = 1
    lr: Num(gt=0) = 1e-3
    min_lr_ratio: Num(ge=0, le=1) = 0.1  # cosine floor, as a fraction of the peak LR
    warmup_steps: NonNegInt = 0
    weight_decay: Num(ge=0) = 0.0
    betas: Annotated[list[Num(ge=0, lt=1)], Field(min_length=2, max_length=2)] = [0.9, 0.95]
    eps: Num(gt=0) = 1e-8
    grad_clip: Num(ge=0) = 1.0  # DeepSpeed gradient_clipping (0 = off)
    lr_mult: PartFloats = PartFloats()
    freeze: PartFlags = PartFlags()
    max_nonfinite_in_row: PosInt = 5  # this many skipped (non-finite) steps in a row abort the run
    lora: LoraSection | None = None  # null = off (full training of the lm part)
    compile: bool = False  # torch.compile each transformer block (vlm/training/compile.py)
    fused_kernels: FusedKernelsSection = FusedKernelsSection()  # CUDA kernels for the loss, norms, SwiGLU
    # recompute in the backward: each block's FFN half (selective) or whole block (full); vlm/training/activation_checkpointing.py
    activation_checkpointing: Literal["none", "selective", "full"] = "none"


class LogSection(Section):
    every_steps: PosInt = 10
    progress_bar: bool = True
    # metric sinks: tensorboard (<run>/tb), wandb (W&B; WANDB_MODE / WANDB_PROJECT / WANDB_DIR from the
    # environment), jsonl (<run>/metrics.jsonl)
    report_to: Annotated[list[Literal[REPORT_TO]], AfterValidator(_unique)] = ["tensorboard", "jsonl"]
    tensorboard: bool | None = None  # shorthand: true adds tensorboard to report_to, false drops it
    jsonl: bool | None = None  # the same for jsonl
    peak_flops: Num(gt=0) | None = None  # per device; None = GPU spec sheet / cached CPU matmul peak (training/peak.py)
    visualize_every: NonNegInt = 0  # boundary picture via vlm.visualize every N steps (0 = never)
    # [first, last]: torch.profiler over those optimizer steps -> <run>/profile.json (GPU idle fraction,
    # top kernels; callbacks/profile_window.py); null = no profiling
    profile_steps: Annotated[list[PosInt], Field(min_length=2, max_length=2)] | None = None

    @property
    def sinks(self) -> list[str]:
        """``report_to`` with the ``tensorboard`` / ``jsonl`` switches applied."""
        out = list(self.report_to)
        for name, flag in (("tensorboard", self.tensorboard), ("jsonl", self.jsonl)):
            if flag is True and name not in out:
                out.append(name)
            elif flag is False and name in out:
                out.remove(name)
        return out


class CheckpointSection(Section):
    every_steps: NonNegInt = 0  # 0 = only at the end
    keep_last: PosInt = 2
    dir: Text | None = None  # default <run>/ckpt
    save_final: bool = True
    export_hf: bool = True  # <run>/hf: model.save_pretrained + processor.save_pretrained


class EvalSection(Section):
    vqa_json: Text | None = None  # held-out digits VQA split; None = no eval at the end
    image_root: Text | None = None
    limit: NonNegInt = 300
    batch_size: PosInt = 64
    max_new_tokens: PosInt = 4
    every_steps: NonNegInt = 0  # also score during training (rank 0, live weights, ZeRO-1/2) every N steps
    periodic_limit: PosInt = 100  # questions per periodic score
    breakdown_by: Text | None = None  # a record field (e.g. kind): accuracy per value too; null = none


class ParallelSection(Section):
    """How the ranks split the model (data parallelism over all ranks is always on)."""
    expert_parallel_size: PosInt = 1  # experts sharded over groups of N ranks (vlm/training/expert_parallel.py)


class TrainConfig(Section):
    name: Annotated[str, AfterValidator(_plain_name)] = "run"
    output_dir: Text = "runs"
    seed: Annotated[int, Field(ge=0, lt=2**32)] = 0
    deepspeed: Annotated[str, AfterValidator(_deepspeed)] = "zero2"  # a ZeRO preset or a JSON path
    deepspeed_overrides: dict = {}  # merged into that JSON (free-form DeepSpeed keys)
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    device: Literal["auto", "cpu", "cuda"] = "auto"
    cpu_threads: PosInt | None = None  # torch threads per CPU process; null = OMP_NUM_THREADS or cores / ranks
    dist_timeout_s: PosInt = 1800  # a collective waiting longer (a dead or stuck rank) ends the run
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    train: TrainSection = TrainSection()
    log: LogSection = LogSection()
    checkpoint: CheckpointSection = CheckpointSection()
    eval: EvalSection = EvalSection()
    parallel: ParallelSection = ParallelSection()
    _source: str | None = PrivateAttr(None)  # the YAML it came from (informational)

    @property
    def source(self) -> str | None:
        return self._source

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    @property
    def ckpt_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_dir / "ckpt"

    def deepspeed_json(self) -> Path:
        if self.deepspeed in ZERO_PRESETS:
            return REPO_ROOT / "configs" / "deepspeed" / f"{self.deepspeed}.json"
        return Path(self.deepspeed)

    def to_dict(self) -> dict:
        out = self.model_dump()
        out["model"].update(unflatten(out["model"].pop("overrides")))
        return out

    def check_across(self) -> None:
        """What involves more than one field."""
        t = self.train
        check(t.stop_at_step is None or t.stop_at_step <= t.max_steps, "train.stop_at_step",
              f"must lie in [1, train.max_steps={t.max_steps}], got {t.stop_at_step}")
        ps = self.log.profile_steps
        check(ps is None or ps[0] <= ps[1], "log.profile_steps", f"must be [first, last] with first <= last, got {ps}")
        check(not (self.model.kind == "lm" and t.stage == "align"), "train.stage",
              "'align' trains the projector and needs model.kind: vlm")
        m = self.model
        check(m.preset is not None or bool(m.init_from), "model.preset",
              "null needs model.init_from (an export that brings its own architecture)")
        check(m.preset is not None or not (m.llm and m.kind == "vlm"), "model.preset",
              "a VLM from model.llm needs a preset with vision: and projector: (configs/model/llava.yaml)")
        check(self.data.kind != "mixture" or bool(self.data.config or self.data.datasets), "data.config",
              "a mixture needs data.config (a data YAML) or data.datasets")
        for i, entry in enumerate(self.data.datasets or []):
            build(DatasetEntry, entry, f"data.datasets[{i}].")


def load_train_config(path: str | Path | None = None, overrides: list[str] | dict | None = None,
                      raw: dict | None = None) -> TrainConfig:
    """YAML file and/or a raw dict, then overrides (``["train.lr=1e-3", ...]`` or a dict) -> TrainConfig."""
    data = deep_merge(read_yaml(path), raw or {}) if path is not None else dict(raw or {})
    cfg = build(TrainConfig, apply_overrides(data, overrides))
    cfg.check_across()
    cfg._source = os.fspath(path) if path is not None else None
    return cfg
