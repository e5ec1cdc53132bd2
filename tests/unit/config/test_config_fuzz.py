"""Config fuzz (hypothesis): every field of the model config (vlm/modeling/configuration_conceptmoe.py), the VLM config
(vlm/modeling/configuration_conceptmoe_vl.py) and the training config (vlm/config/train.py) given random INVALID
values - wrong types, out of range (negative, zero where positive is required, NaN / +-inf /
too-large-for-a-float numbers), unknown enum strings, wrong-length or wrong-content lists - fails
with a ``ConfigError`` whose message is ONE line that names the field by its dotted path
(``moe.top_k``, ``vision.backbone``, ``train.lr``, ``data.datasets[0].type``, ``model.moe.top_k``).

Each field has a rule (a strategy of invalid values for it, given the base config); a coverage test
enumerates the fields of the config sections and fails when a field has no rule.

Examples per test in the ``ci`` profile (8 per field; ``VLM_FUZZ_PROFILE=faults``: 8x, random):

    test_fuzz_model_config           46 fields x 8 = 368   ConceptMoEConfig from sectioned YAML + overrides
    test_fuzz_vlm_config             19 fields x 8 = 152   ConceptMoEVLMConfig.from_sections (the YAML route)
    test_fuzz_vlm_text_config        46 fields x 3 = 138   the language-model fields under the VLM's ``text:``
    test_fuzz_train_config           90 fields: 721       load_train_config(raw + dotted overrides); the
                                                           model keys (``model.moe.top_k``) via build_model_config
                                                   ----
                                                   1379   generated cases in total

(the exact numbers are printed at teardown: "config fuzz examples run [profile ci]: ...").
The CLI surfaces these as one line on stderr and exit code 2 (``test_cli_bad_override_is_one_line``).
"""
from __future__ import annotations

import copy
import inspect
import re
import sys
import typing
from collections import Counter
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from _fuzz import FUZZ, examples, report
from vlm.modeling.vision_registry import VISION_BACKBONES
from vlm.modeling.projector import ProjectorConfig
from vlm.modeling.vision_base import VisionEncoderConfig
from vlm.modeling.vision_base import FEATURE_LAYERS, IMAGE_ASPECTS
from vlm.modeling.projector import PROJECTOR_KINDS, PROJECTOR_MERGES
from vlm.modeling.configuration_conceptmoe import AttentionConfig, ChunkingConfig, ConceptMoEConfig, MoEConfig
from vlm.modeling.config_base import ConfigError, read_yaml
from vlm.modeling.config_base import Section
from vlm.modeling.configuration_conceptmoe import field_key
from vlm.config.train import PARTS, REPORT_TO, STAGES, ZERO_PRESETS, TrainConfig, load_train_config
from vlm.modeling.configuration_conceptmoe_vl import TOKEN_FIELDS as _TOKEN_FIELDS
from vlm.modeling.configuration_conceptmoe_vl import ConceptMoEVLMConfig

ROOT = Path(__file__).resolve().parents[3]
MODEL_YAML, VLM_YAML, TRAIN_YAML = (ROOT / "configs/model/tiny_concept.yaml", ROOT / "configs/model/vlm_tiny.yaml",
                                    ROOT / "configs/train/default.yaml")
MODEL_RAW = yaml.safe_load(MODEL_YAML.read_text())  # chunking on: 4 layers (1 enc, 2 concept, 1 dec), 8 experts, top-2
VLM_RAW = yaml.safe_load(VLM_YAML.read_text())
TRAIN_RAW = read_yaml(TRAIN_YAML)
RUNS: Counter = Counter()


@pytest.fixture(scope="module", autouse=True)
def _report_counts(request):
    yield
    report(request, RUNS, "config fuzz examples run")


def assert_one_line(key: str, fn, *args, **kwargs) -> str:
    """fn(...) raises ConfigError: one line, 'config error: ...', naming ``key`` as a whole word."""
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("config error: "), msg
    assert re.search(rf"(?<!\w){re.escape(key)}(?!\w)", msg), f"{key!r} not named in {msg!r}"
    return msg


# ----- strategies of invalid values ---------------------------------------------------------------
NAN, INF = float("nan"), float("inf")
HUGE = 10**400  # an int no float can hold


def _is_number_text(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


TEXT = st.text(max_size=8).filter(lambda s: not _is_number_text(s))  # the train config reads "1e-3" as a number
INTS, FLOATS, BOOLS = st.integers(), st.floats(), st.booleans()
LISTS = st.lists(st.integers(), max_size=2)
DICTS = st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
_WRONG = {"int": [TEXT, FLOATS, BOOLS, LISTS, DICTS], "float": [TEXT, BOOLS, LISTS, DICTS],
          "bool": [INTS, TEXT, FLOATS, LISTS, DICTS], "str": [INTS, FLOATS, BOOLS, LISTS, DICTS],
          "list": [INTS, TEXT, FLOATS, BOOLS, DICTS], "dict": [INTS, TEXT, FLOATS, BOOLS, LISTS]}


def wrong_type(kind: str, nullable: bool = False):
    return st.one_of(*_WRONG[kind], *([] if nullable else [st.none()]))


def below(lo: int, kind: str = "int", nullable: bool = False):
    """Integers < lo, or a value of the wrong type."""
    return st.one_of(st.integers(max_value=lo - 1), wrong_type(kind, nullable))


def above(hi: int):
    return st.integers(min_value=hi + 1)


def bad_float(low: float, strict: bool = False, high: float | None = None, nullable: bool = False):
    """Numbers outside [low, high] (or <= low when strict), NaN, +-inf, HUGE, or a wrong type."""
    parts = [st.floats(max_value=low, exclude_max=not strict), st.sampled_from([NAN, INF, -INF, HUGE]),
             st.integers(max_value=int(low) - (0 if strict and low == int(low) else 1)), wrong_type("float", nullable)]
    if high is not None:
        parts.append(st.floats(min_value=high, exclude_min=True))
    return st.one_of(*parts)


def not_one_of(choices, nullable: bool = False):
    return st.one_of(st.text(max_size=12).filter(lambda s: s not in choices), wrong_type("str", nullable))


def empty_path(nullable: bool = True):
    """A path field: an empty / blank string or a wrong type."""
    return st.one_of(st.sampled_from(["", "  "]), wrong_type("str", nullable))


NOT_MAPPING = st.one_of(INTS, st.text(max_size=8), FLOATS, BOOLS, LISTS)


# ----- model config ---------------------------------------------------------------------------------
def model_field_keys() -> set[str]:
    return {field_key(name) for name in ConceptMoEConfig.known_keys()}


def _bad_loop_layers():
    bad = st.one_of(st.integers(max_value=-1), st.integers(min_value=2), TEXT, FLOATS, BOOLS, st.none())
    return st.one_of(wrong_type("list"), st.tuples(st.lists(st.sampled_from([0, 1]), max_size=2),
                                                   st.lists(bad, min_size=1, max_size=2)).map(lambda t: t[0] + t[1]))


def _bad_token_id(vocab: int = 2048, allow_list: bool = False):
    parts = [st.integers(max_value=-1), st.integers(min_value=vocab), TEXT, FLOATS, BOOLS, DICTS]
    if allow_list:
        parts.append(st.lists(st.integers(max_value=-1), min_size=1, max_size=2))
    return st.one_of(*parts)


MODEL_RULES = {
    # base (tiny_concept.yaml): hidden 64, 4 heads, 2 kv heads, 8 experts, top-2, 4 layers = 1 enc + 2 concept + 1 dec
    "attention.hidden_size": st.one_of(below(1), st.integers(1, 10**6).filter(lambda h: h % 4 or (h // 4) % 2)),
    "attention.num_attention_heads": st.one_of(below(1), st.integers(1, 10**6).filter(
        lambda n: 64 % n or (64 // n) % 2 or n % 2)),
    "attention.num_key_value_heads": st.one_of(below(1), st.integers(1, 10**6).filter(lambda k: 4 % k)),
    "attention.head_dim": st.one_of(below(1, nullable=True), st.integers(1, 10**6).filter(lambda d: d % 2)),
    "attention.rope_theta": bad_float(0, strict=True),
    "attention.max_position_embeddings": below(1),
    "attention.rms_norm_eps": bad_float(0, strict=True),
    "attention.qkv_bias": wrong_type("bool"),
    "attention.o_proj_bias": wrong_type("bool"),
    "attention.qk_norm": not_one_of(("none", "head", "full")),
    "attention.rope_scaling_params": st.one_of(st.sampled_from([{}, {"rope_type": "dynamic", "factor": 2.0},
                                                         {"rope_type": "linear"}, {"rope_type": "linear", "factor": 0},
                                                         {"rope_type": "yarn", "factor": 4.0}]),
                                        wrong_type("dict", nullable=True)),
    "moe.num_experts": below(2),  # 1 < top_k = 2
    "moe.top_k": st.one_of(below(1), above(8)),
    "moe.moe_intermediate_size": below(1),
    "moe.shared_expert_intermediate_size": below(0),
    "moe.first_k_dense": below(0),
    "moe.dense_intermediate_size": below(1),
    "moe.norm_topk_prob": wrong_type("bool"),
    "moe.router_aux_loss_coef": bad_float(0),
    "moe.router_z_loss_coef": bad_float(0),
    "moe.moe_dispatch": not_one_of(("sorted", "loop")),
    "moe.shared_expert_gate": st.one_of(wrong_type("bool"), st.just(True)),  # True: the base has no shared expert
    "chunking.enabled": wrong_type("bool"),
    "chunking.encoder_layers": st.one_of(below(1), above(2)),  # >= 3 leaves no concept layer
    "chunking.decoder_layers": st.one_of(below(1), above(2)),
    "chunking.target_ratio": bad_float(1),
    "chunking.concept_merge": not_one_of(("last", "sum")),
    "chunking.boundary_noise_tau": bad_float(0, nullable=True),
    "chunking.ratio_loss_weight": bad_float(0),
    "chunking.router_init": not_one_of(("identity", "random")),
    "chunking.boundary_mode": not_one_of(("dynamic", "fixed", "all")),
    "chunking.modality_policy": not_one_of(("joint", "split_at_switch")),
    # the per-modality targets come in pairs: one alone is invalid, whatever its value
    "chunking.image_target_ratio": st.one_of(bad_float(1, nullable=True), st.floats(1, 100)),
    "chunking.text_target_ratio": st.one_of(bad_float(1, nullable=True), st.floats(1, 100)),
    "chunking.concept_hidden_size": st.one_of(below(1, nullable=True),
                                              st.integers(1, 10**6).filter(lambda c: c % 4 or (c // 4) % 2)),
    "chunking.concept_top_k": st.one_of(below(1, nullable=True), above(8)),
    "chunking.concept_loop_layers": _bad_loop_layers(),  # 2 concept layers: indices 0, 1
    "chunking.concept_loop_times": below(1),
    "chunking.joint_decoding_layers": below(0),
    "vocab_size": below(1),
    "num_hidden_layers": below(3),  # 1 or 2 leave no concept layer
    "tie_word_embeddings": wrong_type("bool"),
    "initializer_range": bad_float(0, strict=True),
    "pad_token_id": _bad_token_id(),
    "bos_token_id": _bad_token_id(),
    "eos_token_id": _bad_token_id(allow_list=True),
}


def test_model_rules_cover_every_field():
    """A new field of AttentionConfig / MoEConfig / ChunkingConfig or a new top-level key fails here
    until it gets a rule of invalid values."""
    fields_ = {field_key(name) for cls in (AttentionConfig, MoEConfig, ChunkingConfig) for name in cls.model_fields}
    assert fields_ <= model_field_keys()
    assert model_field_keys() == set(MODEL_RULES), sorted(model_field_keys() ^ set(MODEL_RULES))


@pytest.mark.parametrize("key", sorted(MODEL_RULES))
@settings(FUZZ, max_examples=examples(8))
@given(data=st.data())
def test_fuzz_model_config(key, data):
    RUNS["model_config"] += 1
    value = data.draw(MODEL_RULES[key], label=key)
    assert_one_line(key, ConceptMoEConfig.from_dict_sections, copy.deepcopy(MODEL_RAW), {key: value})


# ----- VLM config -----------------------------------------------------------------------------------
def _bad_grids():
    """Not a list of [cols, rows] positive-int pairs, empty, or a grid named twice."""
    bad = st.one_of(st.integers(max_value=0), TEXT, FLOATS, BOOLS, st.none(), LISTS)
    bad_pair = st.one_of(wrong_type("list"), st.lists(st.integers(1, 4), max_size=1),
                         st.lists(st.integers(1, 4), min_size=3, max_size=4),
                         st.tuples(bad, st.integers(1, 4)).map(list), st.tuples(st.integers(1, 4), bad).map(list))
    return st.one_of(wrong_type("list"), st.just([]), st.lists(bad_pair, min_size=1, max_size=2),
                     st.tuples(st.integers(1, 4), st.integers(1, 4)).map(lambda g: [list(g), [1, 1], list(g)]))


VLM_RULES = {
    "vision": NOT_MAPPING,
    "vision.backbone": st.one_of(wrong_type("str"), st.just(""),
                                 st.text(max_size=12).filter(lambda s: s not in VISION_BACKBONES)),
    "vision.model_name": st.one_of(wrong_type("str", nullable=True), st.just(""),
                                   st.text(max_size=8).filter(lambda s: "/" not in s).map(lambda s: "hf-hub:" + s)),
    "vision.pretrained": st.one_of(wrong_type("str", nullable=True), st.just("")),
    "vision.trust_pickle": wrong_type("bool"),
    "vision.feature_layer": not_one_of(FEATURE_LAYERS),
    "vision.keep_cls": wrong_type("bool"),
    "vision.image_size": below(1, nullable=True),
    "vision.image_aspect": not_one_of(IMAGE_ASPECTS),
    "vision.anyres_grids": _bad_grids(),
    "vision.model_kwargs": wrong_type("dict"),
    "projector": NOT_MAPPING,
    "projector.kind": not_one_of(PROJECTOR_KINDS),
    "projector.merge": not_one_of(PROJECTOR_MERGES),
    "projector.keep": below(1, nullable=True),
    "text_preset": st.one_of(*_WRONG["str"], st.just(""), st.text("abcxyz", min_size=1, max_size=8).map(
        lambda s: f"missing_{s}.yaml")),
    "text": NOT_MAPPING,
    **{name: _bad_token_id() for name in _TOKEN_FIELDS},
}


def _vlm_from(key: str, value):
    raw = copy.deepcopy(VLM_RAW)
    head, _, rest = key.partition(".")
    if rest:
        raw[head][rest] = value
    else:
        raw[head] = value
    return ConceptMoEVLMConfig.from_sections(raw, base_dir=VLM_YAML.parent)


def test_vlm_rules_cover_every_field():
    expected = ({f"vision.{name}" for name in VisionEncoderConfig.model_fields}
                | {f"projector.{name}" for name in ProjectorConfig.model_fields}
                | {"vision", "projector", "text", "text_preset", *_TOKEN_FIELDS})
    assert expected == set(VLM_RULES), sorted(expected ^ set(VLM_RULES))
    # every constructor argument is one of them (text_config <- text_preset + text)
    params = set(inspect.signature(ConceptMoEVLMConfig.__init__).parameters) - {"self", "kwargs"}
    assert params - {"text_config"} <= set(VLM_RULES) and "text_config" in params


@pytest.mark.parametrize("key", sorted(VLM_RULES))
@settings(FUZZ, max_examples=examples(8))
@given(data=st.data())
def test_fuzz_vlm_config(key, data):
    RUNS["vlm_config"] += 1
    value = data.draw(VLM_RULES[key], label=key)
    assert_one_line(key, _vlm_from, key, value)


@pytest.mark.parametrize("key", sorted(MODEL_RULES))
@settings(FUZZ, max_examples=examples(3))
@given(data=st.data())
def test_fuzz_vlm_text_config(key, data):
    """The language model's fields under the VLM's ``text:`` section (the VLM's text_config)."""
    RUNS["vlm_text_config"] += 1
    value = data.draw(MODEL_RULES[key], label=key)
    raw = copy.deepcopy(VLM_RAW)
    section, _, name = key.rpartition(".")
    target = raw.setdefault("text", {})
    if section:
        target = target.setdefault(section, {})
    target[name] = value
    assert_one_line(key, ConceptMoEVLMConfig.from_sections, raw, base_dir=VLM_YAML.parent)


# ----- training config ------------------------------------------------------------------------------
def _bad_dataset_entry():
    ok = {"type": "llava_json", "path": "x.json"}
    return st.one_of(
        NOT_MAPPING,
        not_one_of(("llava_json", "text")).map(lambda t: {**ok, "type": t}),
        st.one_of(st.sampled_from(["", " "]), INTS, st.none(), LISTS).map(lambda p: {**ok, "path": p}),
        bad_float(0).map(lambda w: {**ok, "weight": w}),
        st.one_of(st.integers(max_value=0), TEXT, FLOATS).map(lambda m: {**ok, "max_image_pixels": m}),
        st.one_of(st.sampled_from(["", " "]), INTS).map(lambda n: {**ok, "name": n}),
        st.text(min_size=1, max_size=8).filter(lambda k: k not in ("name", "type", "path", "image_root", "weight",
                                                                   "max_image_pixels")).map(lambda k: {**ok, k: 1}),
    )


def _bad_betas():
    good = st.floats(0, 0.99)
    bad = st.one_of(st.floats(min_value=1), st.floats(max_value=0, exclude_max=True), st.sampled_from([NAN, INF, HUGE]),
                    BOOLS, TEXT, st.none())
    return st.one_of(wrong_type("list"), st.lists(good, max_size=1), st.lists(good, min_size=3, max_size=4),
                     st.tuples(good, bad).map(list), st.tuples(bad, good).map(list))


def _bad_name_list(choices=None):
    """Not a list of distinct names: a wrong type, a blank / non-string / unknown entry, or a name twice
    (``choices``: the allowed names; None = any non-blank string)."""
    ok = sorted(choices) if choices else ["q_proj", "v_proj"]
    bad = st.one_of(INTS, FLOATS, BOOLS, st.none(), LISTS,
                    not_one_of(choices) if choices else st.sampled_from(["", "  "]))
    return st.one_of(wrong_type("list"), st.tuples(st.lists(st.sampled_from(ok), max_size=1, unique=True), bad).map(
        lambda t: t[0] + [t[1]]), st.sampled_from(ok).map(lambda name: [name, name]))


def _model_override():
    return st.sampled_from(sorted(MODEL_RULES)).flatmap(
        lambda key: MODEL_RULES[key].map(lambda value: (key, value)))


TRAIN_RULES = {
    "name": st.one_of(wrong_type("str"), st.sampled_from(["", ".", ".."]),
                      st.text(max_size=6).map(lambda s: s + "/x")),
    "output_dir": empty_path(nullable=False),
    "seed": st.one_of(below(0), st.integers(min_value=2**32)),
    "deepspeed": st.one_of(wrong_type("str"), st.text(max_size=10).filter(
        lambda s: s not in ZERO_PRESETS and not Path(s).is_file())),
    "deepspeed_overrides": wrong_type("dict"),
    "precision": not_one_of(("auto", "fp32", "bf16")),
    "device": not_one_of(("auto", "cpu", "cuda")),
    "cpu_threads": below(1, nullable=True),
    "dist_timeout_s": below(1),
    "source": st.one_of(INTS, TEXT, st.none()),  # informational, set by the loader: not a key
    "model": NOT_MAPPING,
    "model.kind": not_one_of(("vlm", "lm")),
    "model.preset": empty_path(),
    "model.llm": empty_path(),
    "model.tokenizer": empty_path(),
    "model.init_from": empty_path(),
    "model.overrides": _model_override(),  # every other model key, checked by the model config
    "data": NOT_MAPPING,
    "data.kind": not_one_of(("mixture", "synthetic")),
    "data.config": empty_path(),
    "data.num_workers": below(0),
    "data.root": empty_path(),
    "data.max_length": below(2, nullable=True),
    "data.packing": wrong_type("bool", nullable=True),
    "data.padding_side": not_one_of(("right", "left"), nullable=True),
    "data.pad_to_max_length": wrong_type("bool", nullable=True),
    "data.max_bad_fraction": bad_float(0, high=1, nullable=True),
    "data.min_samples_for_bad_check": below(0, nullable=True),
    "data.block_size": below(1, nullable=True),
    "data.shuffle": wrong_type("bool", nullable=True),
    "data.num_samples": below(1, nullable=True),
    "data.datasets": st.one_of(wrong_type("list", nullable=True), st.just([]),
                               st.tuples(st.integers(0, 2), _bad_dataset_entry()).map(
                                   lambda t: [{"type": "text", "path": "a.txt"}] * t[0] + [t[1]])),
    "data.synthetic_vocab": below(8),
    "train": NOT_MAPPING,
    "train.stage": not_one_of(STAGES),
    "train.max_steps": below(1),
    "train.stop_at_step": st.one_of(below(1, nullable=True), above(TRAIN_RAW["train"]["max_steps"])),
    "train.micro_batch_size": below(1),
    "train.grad_accum": below(1),
    "train.lr": st.one_of(bad_float(0, strict=True), st.sampled_from(["nan", "-inf", "-1e-3", "0"])),
    "train.min_lr_ratio": bad_float(0, high=1),
    "train.warmup_steps": below(0),
    "train.weight_decay": bad_float(0),
    "train.betas": _bad_betas(),
    "train.eps": bad_float(0, strict=True),
    "train.grad_clip": bad_float(0),
    "train.lr_mult": NOT_MAPPING,
    **{f"train.lr_mult.{part}": bad_float(0) for part in PARTS},
    "train.freeze": NOT_MAPPING,
    **{f"train.freeze.{part}": wrong_type("bool", nullable=True) for part in PARTS},
    "train.max_nonfinite_in_row": below(1),
    "train.compile": wrong_type("bool"),
    "train.activation_checkpointing": not_one_of(("none", "selective", "full")),
    "train.fused_kernels": NOT_MAPPING,
    "train.fused_kernels.cross_entropy": not_one_of(("auto", "torch", "liger")),
    "train.fused_kernels.rms_norm": not_one_of(("auto", "torch", "liger")),
    "train.fused_kernels.swiglu": not_one_of(("auto", "torch", "triton")),
    "train.lora": NOT_MAPPING,  # null = off
    "train.lora.r": below(1),
    "train.lora.alpha": bad_float(0, strict=True),
    "train.lora.dropout": bad_float(0, high=1),
    "train.lora.target_modules": st.one_of(st.just([]), _bad_name_list()),
    "log": NOT_MAPPING,
    "log.every_steps": below(1),
    "log.progress_bar": wrong_type("bool"),
    "log.report_to": _bad_name_list(REPORT_TO),
    "log.tensorboard": wrong_type("bool", nullable=True),
    "log.jsonl": wrong_type("bool", nullable=True),
    "log.peak_flops": bad_float(0, strict=True, nullable=True),
    "log.visualize_every": below(0),
    "log.profile_steps": st.one_of(  # not [first, last] with 1 <= first <= last
        wrong_type("list", nullable=True), st.lists(st.integers(1, 9), max_size=1),
        st.lists(st.integers(1, 9), min_size=3, max_size=4),
        st.tuples(st.integers(max_value=0), st.integers(1, 9)).map(list),
        st.integers(2, 9).map(lambda a: [a, a - 1])),
    "checkpoint": NOT_MAPPING,
    "checkpoint.every_steps": below(0),
    "checkpoint.keep_last": below(1),
    "checkpoint.dir": empty_path(),
    "checkpoint.save_final": wrong_type("bool"),
    "checkpoint.export_hf": wrong_type("bool"),
    "eval": NOT_MAPPING,
    "eval.vqa_json": empty_path(),
    "eval.image_root": empty_path(),
    "eval.limit": below(0),
    "eval.batch_size": below(1),
    "eval.max_new_tokens": below(1),
    "eval.every_steps": below(0),
    "eval.periodic_limit": below(1),
    "eval.breakdown_by": empty_path(),
    "data.index_cache_dir": empty_path(),
    "parallel": NOT_MAPPING,
    "parallel.expert_parallel_size": below(1),
}


def train_field_paths(cls=TrainConfig, prefix: str = "") -> set[str]:
    """Every field of TrainConfig and its sections, dotted (a section is a field too)."""
    paths = set()
    for name, f in cls.model_fields.items():
        paths.add(prefix + name)
        for sub in typing.get_args(f.annotation) or (f.annotation,):  # a section or ``Section | None``
            if isinstance(sub, type) and issubclass(sub, Section):
                paths |= train_field_paths(sub, f"{prefix}{name}.")
    return paths


def test_train_rules_cover_every_field():
    """A new field of TrainConfig or of one of its sections fails here until it gets a rule
    (``source`` is set by the loader, never by a user: it has a rule that it is refused)."""
    paths = train_field_paths() | {"source"}
    assert paths == set(TRAIN_RULES), sorted(paths ^ set(TRAIN_RULES))


def _load_train(key: str, value):
    return load_train_config(None, raw=copy.deepcopy(TRAIN_RAW), overrides={key: value})


@pytest.mark.parametrize("key", sorted(TRAIN_RULES))
@settings(FUZZ, max_examples=examples(8))
@given(data=st.data())
def test_fuzz_train_config(key, data):
    RUNS["train_config"] += 1
    value = data.draw(TRAIN_RULES[key], label=key)
    if key != "model.overrides":
        assert_one_line(key, _load_train, key, value)
        return
    from vlm.training.build import build_model_config  # the model keys are checked where the model is built

    model_key, model_value = value
    cfg = _load_train(f"model.{model_key}", model_value)
    msg = assert_one_line(model_key, build_model_config, cfg)  # the field, as the model config names it ...
    assert msg.startswith("config error: model."), msg  # ... under the train config's model section


def test_control_characters_in_a_key_stay_one_line():
    """Found by the faults profile: a mapping with a newline key under a model field used to print
    the newline raw (two lines). ConfigError escapes control characters."""
    from vlm.training.build import build_model_config

    cfg = _load_train("model.attention.head_dim", {"\n": 0})
    msg = assert_one_line("attention.head_dim", build_model_config, cfg)
    assert "\\n" in msg
    assert_one_line("train.lr", _load_train, "train.lr", "1e-3\n\x00")


def test_yaml_file_route(tmp_path):
    """The same one line when the bad value comes from a YAML file (one field of each config)."""
    raw = copy.deepcopy(TRAIN_RAW)
    raw["train"]["lr"] = float("nan")
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert_one_line("train.lr", load_train_config, path)
    model = copy.deepcopy(MODEL_RAW)
    model["moe"]["top_k"] = 9
    path.write_text(yaml.safe_dump(model))
    assert_one_line("moe.top_k", ConceptMoEConfig.from_yaml, path)
    vlm = copy.deepcopy(VLM_RAW)
    vlm["vision"]["backbone"] = "no-such-vit"
    vlm["text_preset"] = str(MODEL_YAML)
    path.write_text(yaml.safe_dump(vlm))
    assert_one_line("vision.backbone", ConceptMoEVLMConfig.from_yaml, path)


@pytest.mark.parametrize("override, key", [
    ("train.lr=-1", "train.lr"), ("train.lr=.nan", "train.lr"), ("seed=-3", "seed"),
    ("data.max_bad_fraction=2", "data.max_bad_fraction"), ("train.betas=[0.9]", "train.betas"),
    ("data.datasets=[{type: csv, path: a}]", "data.datasets[0].type"), ("nonsense=1", "nonsense"),
    ("train.lr", "train.lr"),
])
def test_cli_bad_override_is_one_line(override, key, capsys, monkeypatch):
    """python -m vlm.train --config ... <bad override>: one line on stderr, exit code 2 (in-process;
    these fail while loading the config, before the trainer or torch.distributed start)."""
    from vlm import train

    monkeypatch.setitem(sys.modules, "wandb", sys.modules.get("wandb"))  # main() hides wandb: undone after
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    assert train.main(["--config", str(TRAIN_YAML), override]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: config error: "), err
    assert re.search(rf"(?<!\w){re.escape(key)}(?!\w)", err), err
