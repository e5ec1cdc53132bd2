"""Parameter parts, stage freezing (per stage YAML), AdamW groups (no decay, LR multipliers), schedule."""
from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from vlm.training import optim
from vlm.training.build import build_model, build_model_config
from vlm.config.train import load_train_config

ROOT = Path(__file__).resolve().parents[3]
TRAIN = ROOT / "configs" / "train"


def _model(cfg):
    torch.manual_seed(0)
    return build_model(build_model_config(cfg), cfg.model.kind)


@pytest.fixture(scope="module")
def vlm_model():
    cfg = load_train_config(TRAIN / "default.yaml", ["model.tokenizer=null"])
    return _model(cfg)


def test_every_parameter_has_one_part(vlm_model):
    parts = optim.param_parts(vlm_model)
    assert set(parts.values()) == set(optim.PARTS)
    assert all(parts[n] == "vision" for n in parts if n.startswith("vision."))
    assert all(parts[n] == "projector" for n in parts if n.startswith("projector."))
    assert {n for n in parts if parts[n] == "chunker"} == {
        "language_model.model.chunker.q_proj.weight", "language_model.model.chunker.k_proj.weight"}
    assert parts["language_model.lm_head.weight"] == "lm"


@pytest.mark.parametrize("stage, trainable", [
    ("align", {"projector"}),
    ("finetune", {"projector", "chunker", "lm"}),
    ("full", {"vision", "projector", "chunker", "lm"}),
])
def test_stage_yaml_freezes_exactly_what_it_says(vlm_model, stage, trainable):
    cfg = load_train_config(TRAIN / f"{stage}.yaml", ["model.tokenizer=null", "model.init_from=null"])
    assert optim.trainable_parts(cfg) == trainable
    counts = optim.apply_freeze(vlm_model, optim.trainable_parts(cfg))
    total = optim.count_params(vlm_model)
    for part in optim.PARTS:
        assert counts[part] == (total[part] if part in trainable else 0), (stage, part)
        assert total[part] > 0
    groups = optim.param_groups(vlm_model, cfg)
    assert {g["part"] for g in groups} == trainable
    n_in_groups = sum(p.numel() for g in groups for p in g["params"])
    assert n_in_groups == sum(counts.values())


def test_freeze_override_and_vision_lr(vlm_model):
    cfg = load_train_config(TRAIN / "finetune.yaml", ["model.tokenizer=null", "model.init_from=null",
                                                      "train.freeze.vision=false", "train.lr_mult.vision=0.1",
                                                      "train.freeze.chunker=true"])
    assert optim.trainable_parts(cfg) == {"vision", "projector", "lm"}
    optim.apply_freeze(vlm_model, optim.trainable_parts(cfg))
    groups = optim.param_groups(vlm_model, cfg)
    for g in groups:
        assert g["lr"] == pytest.approx(cfg.train.lr * getattr(cfg.train.lr_mult, g["part"]))
    assert any(g["part"] == "vision" and g["lr"] == pytest.approx(cfg.train.lr * 0.1) for g in groups)


def test_no_weight_decay_on_norms_biases_embeddings(vlm_model):
    cfg = load_train_config(TRAIN / "full.yaml", ["model.tokenizer=null", "train.weight_decay=0.1"])
    optim.apply_freeze(vlm_model, optim.trainable_parts(cfg))
    groups = optim.param_groups(vlm_model, cfg)
    wd = {name: g["weight_decay"] for g in groups for name in g["param_names"]}
    for name, p in vlm_model.named_parameters():
        no_decay = (p.ndim < 2 or name.endswith(".bias") or "embed_tokens" in name or "pos_embed" in name
                    or "cls_token" in name)
        assert wd[name] == (0.0 if no_decay else 0.1), name
    assert wd["language_model.model.embed_tokens.weight"] == 0.0
    assert wd["language_model.model.norm.weight"] == 0.0
    assert any("w_gate" in n and v == 0.1 for n, v in wd.items())  # expert weights decay
    assert wd["language_model.model.chunker.q_proj.weight"] == 0.1


def test_text_lm_parts():
    cfg = load_train_config(None, raw={"model": {"kind": "lm", "preset": "configs/model/tiny_concept.yaml"},
                                        "data": {"kind": "synthetic"}})
    model = _model(cfg)
    counts = optim.apply_freeze(model, optim.trainable_parts(cfg))
    assert counts["vision"] == counts["projector"] == 0 and counts["chunker"] > 0 and counts["lm"] > 0
    with pytest.raises(Exception, match="train.stage"):
        load_train_config(None, raw={"model": {"kind": "lm"}, "data": {"kind": "synthetic"}, "train": {"stage": "align"}})


def test_warmup_cosine_schedule():
    f = optim.WarmupCosine(warmup_steps=10, max_steps=110, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    vals = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(vals))
    g = optim.WarmupCosine(0, 100, 0.0)
    assert g(0) == 1.0 and g(50) == pytest.approx(0.5) and g(100) == pytest.approx(0.0, abs=1e-12)
    # LambdaLR keeps per-group multipliers
    p1, p2 = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [p1], "lr": 1.0}, {"params": [p2], "lr": 0.1}])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, f)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1, 0.01])
    for _ in range(10):
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1.0, 0.1])
    assert math.isfinite(sched.get_last_lr()[0])
