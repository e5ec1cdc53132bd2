"""``train.lora`` (peft adapters on the language model) and ``log.report_to`` (W&B offline): a tiny VLM
trains a few steps with LoRA in stage finetune and only the adapters + the stage's other parts
(projector, chunker) change; the merged HF export, reloaded with ``from_pretrained``, has no peft keys
and gives the adapter model's logits; a resume from a checkpoint continues exactly; a bad target is
one line; ``report_to: [wandb]`` writes an offline W&B run whose history holds the logged loss."""
from __future__ import annotations

import glob
import json
import sys
from pathlib import Path

import _train_helpers as helpers
import pytest
import torch

from vlm.modeling.config_base import ConfigError

LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "o_proj"]}


def _raw(tmp: Path, name: str, **sections) -> dict:
    return helpers.config(tmp, base=helpers.TINY_VLM, name=name,
                          train={"stage": "finetune", "max_steps": 4, "lora": LORA, **sections.pop("train", {})},
                          checkpoint={"every_steps": 2, "keep_last": 3, "export_hf": True,
                                      **sections.pop("checkpoint", {})}, **sections)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A 4-step LoRA run (checkpoints at 2 and 4, HF export) and the model's starting weights."""
    from vlm.config.train import load_train_config
    from vlm.training.build import setup_model
    from vlm.training.trainer import seed_everything

    tmp = tmp_path_factory.mktemp("lora")
    raw = _raw(tmp, "full")
    cfg = load_train_config(raw=raw)
    seed_everything(cfg.seed)  # as the trainer does: the same starting weights
    start = {k: v.clone() for k, v in setup_model(cfg, log_line=lambda _: None).model.state_dict().items()}
    trainer = helpers.run_inprocess(raw, tmp, finish=True)
    return tmp, trainer, start


def test_only_adapters_and_stage_parts_train(lora_run):
    from vlm.training.optim import param_parts

    tmp, trainer, start = lora_run
    module = trainer.engine.module
    parts = param_parts(module)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    lora_names = {n for n in parts if ".lora_A." in n or ".lora_B." in n}
    assert lora_names and all(parts[n] == "lm" for n in lora_names)
    # 4 layers x (q, v, o) adapters, A and B each; nothing else of the lm part trains
    assert {n for n in trainable if parts[n] == "lm"} == lora_names and len(lora_names) == 4 * 3 * 2
    assert {parts[n] for n in trainable} == {"lm", "projector", "chunker"}
    n_lora = sum(p.numel() for n, p in module.named_parameters() if n in lora_names)
    assert trainer.trainable_counts["lm"] == n_lora and trainer.trainable_counts["vision"] == 0
    changed, same = set(), set()
    for name, value in module.state_dict().items():
        if name in lora_names:
            continue
        base = name.replace(".base_layer.", ".")
        (same if torch.equal(value, start[base]) else changed).add(name)
    assert {parts.get(n, "lm") for n in changed} == {"projector", "chunker"}, sorted(changed)[:5]
    assert any(parts[n] == "lm" for n in same) and any(parts[n] == "vision" for n in same)
    lora_b = [p for n, p in module.named_parameters() if ".lora_B." in n]  # zero at the start
    assert all(float(p.detach().abs().max()) > 0 for p in lora_b)


def test_merged_export_gives_the_adapter_logits(lora_run):
    from vlm.modeling.modeling_conceptmoe_vl import ConceptMoEVLMForConditionalGeneration

    tmp, trainer, _ = lora_run
    hf = tmp / "full" / "hf"
    merged = ConceptMoEVLMForConditionalGeneration.from_pretrained(str(hf)).float().eval()
    keys = list(merged.state_dict())
    assert not [k for k in keys if "lora_" in k or "base_layer" in k]
    from safetensors import safe_open

    with safe_open(str(next(hf.glob("*.safetensors"))), "pt") as f:
        assert not [k for k in f.keys() if "lora_" in k or "base_layer" in k]
    adapter = trainer.engine.module.eval()
    batch = next(iter(trainer.loader))
    inputs = {k: v for k, v in trainer._inputs(batch).items() if k != "labels"}
    with torch.no_grad():
        want = adapter(**inputs).logits
        got = merged(**inputs).logits
    diff = float((want - got).abs().max())
    print(f"merged export vs adapter model: max |logit diff| {diff:.2e}")
    assert diff <= 1e-5, diff


def test_resume_continues_exactly(lora_run):
    tmp, trainer, _ = lora_run
    ref = {r["step"]: r for r in helpers.records(tmp / "full")}
    resumed = helpers.run_inprocess(_raw(tmp, "resumed", checkpoint={"export_hf": False}), tmp,
                                    resume=str(tmp / "full" / "ckpt" / "step_000002"))
    rest = helpers.records(tmp / "resumed")
    assert [r["step"] for r in rest] == [3, 4]
    for key in ("loss", "lm_loss", "grad_norm", "lr"):
        assert [r[key] for r in rest] == [ref[s][key] for s in (3, 4)], key
    final = dict(trainer.engine.module.named_parameters())
    for name, p in resumed.engine.module.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, final[name]), name


@pytest.mark.parametrize("target", ["w_gate", "chunker.q_proj", "lm_head", "nope"])
def test_bad_target_module_is_one_line(target, tmp_path, capsys, monkeypatch):
    """``python -m vlm.train`` (in-process): one line on stderr naming the key, exit code 2."""
    from vlm import train

    monkeypatch.setitem(sys.modules, "wandb", sys.modules.get("wandb"))  # main() hides wandb: undone after
    raw = _raw(tmp_path, "bad", train={"lora": {**LORA, "target_modules": ["q_proj", target]}})
    path = helpers.write_config(tmp_path, raw)
    assert train.main(["--config", str(path), "--no-eval"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: config error: train.lora.target_modules: "), err
    assert repr(target) in err and "q_proj" in err  # the choices are listed


def test_lora_needs_the_lm_part_to_train(tmp_path):
    with pytest.raises(ConfigError, match=r"^config error: train\.lora: the lm part does not train"):
        helpers.run_inprocess(_raw(tmp_path, "align", train={"stage": "align"}), tmp_path)


def _wandb_history(run_file: Path) -> list[dict]:
    """The history rows of an offline ``run-*.wandb`` file (W&B's own record reader)."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    ds = datastore.DataStore()
    ds.open_for_scan(str(run_file))
    rows = []
    while (data := ds.scan_data()) is not None:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                         for item in rec.history.item})
    return rows


def test_report_to_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb_dir").mkdir()
    raw = helpers.config(tmp_path, name="wb", train={"max_steps": 3}, log={"report_to": ["wandb"]},
                         checkpoint={"every_steps": 0, "save_final": False})
    trainer = helpers.run_inprocess(raw, tmp_path)
    import wandb

    wandb.teardown()  # wait for W&B's writer process (run.finish() may return before it has flushed the file)
    assert not (tmp_path / "wb" / "metrics.jsonl").exists() and not (tmp_path / "wb" / "tb").exists()
    runs = glob.glob(str(tmp_path / "wandb_dir" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, runs
    rows = [r for r in _wandb_history(Path(runs[0])) if "train/loss" in r]
    assert [r["_step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["train/loss"] == pytest.approx(trainer.last_record["loss"], rel=1e-9)
    assert all(any(k.startswith("lr/") for k in r) for r in rows)


def test_report_to_and_the_older_switches():
    """``log.report_to`` picks the sinks; ``log.tensorboard`` / ``log.jsonl`` (null by default) add or drop one."""
    from vlm.config.train import load_train_config

    def sinks(**log):
        return load_train_config(None, raw={"data": {"kind": "synthetic"}, "log": log}).log.sinks

    assert sinks() == ["tensorboard", "jsonl"]
    assert sinks(report_to=["wandb"]) == ["wandb"]
    assert sinks(report_to=["wandb"], jsonl=True) == ["wandb", "jsonl"]
    assert sinks(tensorboard=False) == ["jsonl"]
    assert sinks(report_to=[]) == []


@pytest.mark.integration  # a fresh interpreter
def test_wandb_is_imported_only_when_asked(tmp_path):
    """A logger without ``wandb`` in its sinks never imports it (a fresh interpreter)."""
    import subprocess

    code = ("import sys; from pathlib import Path; from vlm.training.metrics import MetricsLogger; "
            f"log = MetricsLogger(Path({str(tmp_path)!r}), True, 2, 0, False, ['tensorboard', 'jsonl']); "
            "log.log({'step': 1, 'loss': 1.0}); log.close(); print('wandb' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=helpers.REPO_ROOT, env=helpers.clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
