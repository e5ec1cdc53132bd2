"""Starting from pretrained parts: the CPU flow of docs/pretrained.md (tiny stand-ins written by transformers and
tokenizers -> vlm.convert R = 2 -> LLaVA stage 1 -> stage 2) run line by line; every LLM and ViT tensor
after assembly equal to its source; an LM from a transformers folder keeping its logits; and the bad
starts that must stop with one line (exit 2) instead of training random weights."""
from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors.torch import load_file

from _train_helpers import clean_env
from vlm.config.train import REPO_ROOT, load_train_config
from vlm.hf_import import map_weights
from vlm.hf_import.weights import read_safetensors
from vlm.training.build import setup_model

README_MARK = "<!-- tiny-pretrained-flow -->"
STEP_OVERRIDES = {"llava_align": ["train.max_steps=6", "log.every_steps=3"],
                  "llava_finetune": ["train.max_steps=12", "log.every_steps=4", "eval.limit=30", "eval.every_steps=0"]}


def readme_flow() -> list[str]:
    """The command lines of the documented CPU flow (docs/pretrained.md: the bash block after the marker)."""
    text = (REPO_ROOT / "docs" / "pretrained.md").read_text()
    block = text[text.index(README_MARK):].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def _stand_ins():
    spec = importlib.util.spec_from_file_location("tiny_pretrained", REPO_ROOT / "scripts" / "tiny_pretrained.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """llm/ (OLMoE, ChatML tokenizer), llm_r2/ (converted), qwen2/ (dense, tied), vit/ (SigLIP), clip/."""
    from vlm.convert import main as convert

    out = tmp_path_factory.mktemp("parts")
    mod = _stand_ins()
    assert mod.main(["--out", str(out)]) == 0
    tokenizer = T.AutoTokenizer.from_pretrained(out / "llm")
    tokenizer.save_pretrained(out / "qwen2")
    mod.save_llm(out / "qwen2", "qwen2", 512, tokenizer.eos_token_id, tokenizer.pad_token_id)
    mod.save_vit(out / "clip", "clip")
    assert convert(["--from", str(out / "llm"), "--to", str(out / "llm_r2"), "--ratio", "2"]) == 0
    return out


@pytest.mark.integration  # runs the README's commands as processes
def test_readme_two_stage_flow_runs_as_written(tmp_path):
    """The documented lines in a scratch folder (configs / data / scripts linked in), fewer steps."""
    for name in ("configs", "data", "scripts"):
        (tmp_path / name).symlink_to(REPO_ROOT / name)
    lines = readme_flow()
    assert len(lines) == 4 and lines[0].startswith(".venv/bin/python scripts/tiny_pretrained.py")
    outputs, start = [], time.time()
    for line in lines:
        argv = shlex.split(line)
        argv[0] = sys.executable
        stage = next((name for name in STEP_OVERRIDES if f"configs/train/{name}.yaml" in line), None)
        argv += STEP_OVERRIDES.get(stage, []) + (["log.progress_bar=false"] if stage else [])
        proc = subprocess.run(argv, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        outputs.append(proc.stdout + proc.stderr)
    wall = time.time() - start
    print(f"two-stage CPU flow (stand-ins, convert, align 6 steps, finetune 12 steps + eval): {wall:.1f} s")
    assert "R=1 identity check: max |logit difference|" in outputs[1]
    gap = float(re.search(r"R=1 identity check: max \|logit difference\| = (\S+)", outputs[1]).group(1))
    assert gap <= 1e-4
    align, finetune = outputs[2], outputs[3]
    assert "[model] language model <- runs/tiny_parts/llm_r2 (ConceptMoE checkpoint)" in align
    assert "[model] projector: new, random init" in align and "vision: hf SiglipVisionModel" in align
    assert "params (total / trainable): vision 36,288/0, projector 6,272/6,272, chunker 8,192/0, lm " in align
    # the frozen LM counts forward + input gradient; the CPU MFU is against a measured (cached) matmul peak
    assert re.search(r"\((measured|cached \(measured [^)]*\)): fastest 1024x1024 float32 matmul on", align)
    assert "LM training FLOPs: forward + input gradient (frozen LM, the gradient flows through it)" in align
    assert re.search(r"MFU \(last window\) +\| \d+\.\d+% of \S+ FLOP/s/device +\|\n\|   peak +\| (measured|cached)",
                     align), align[-2000:]
    assert "(init_from)" in finetune and "held-out VQA accuracy" in finetune
    runs = tmp_path / "runs"
    # stage 1 trains the projector only: the export's LLM and ViT tensors are the sources' own
    exported = load_file(runs / "llava-align" / "hf" / "model.safetensors")
    source_llm = load_file(runs / "tiny_parts" / "llm_r2" / "model.safetensors")
    n_vocab = 500
    for name, tensor in source_llm.items():
        ours = exported[f"language_model.{name}"]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(ours[:n_vocab], tensor[:n_vocab]) and torch.equal(ours[n_vocab:503], ours[500:503])
        else:
            assert torch.equal(ours, tensor), name
    vit = load_file(runs / "tiny_parts" / "vit" / "model.safetensors")
    for name, tensor in vit.items():
        assert torch.equal(exported[f"vision.model.{name}"], tensor), name
    # stage 2 starts from that export, trains the LM, and its loss falls
    losses = [json.loads(line)["loss"] for line in (runs / "llava-finetune" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert losses[-1] < losses[0] - 0.3, losses
    config = json.loads((runs / "llava-finetune" / "hf" / "config.json").read_text())
    tok = T.AutoTokenizer.from_pretrained(runs / "llava-finetune" / "hf")
    assert tok.convert_ids_to_tokens(config["text_config"]["eos_token_id"]) == "<|im_end|>"
    assert "<|im_start|>" in tok.chat_template


def _train_cfg(tmp_path, **model):
    raw = {"name": "assemble", "output_dir": str(tmp_path), "data": {"kind": "synthetic"},
           "model": {"kind": "vlm", "preset": str(REPO_ROOT / "configs/model/llava.yaml"), "tokenizer": None, **model}}
    return load_train_config(None, raw=raw)


def _hf_vision_tensors(folder: Path) -> dict:
    return load_file(folder / "model.safetensors")


@pytest.mark.parametrize("llm, vit", [("llm_r2", "vit"), ("qwen2", "clip"), ("llm", "vit")])
def test_assembly_keeps_every_pretrained_tensor(parts, tmp_path, llm, vit):
    lines = []
    cfg = _train_cfg(tmp_path, llm=str(parts / llm), vision={"model_name": str(parts / vit), "image_aspect": "resize"})
    setup = setup_model(cfg, lines.append)
    model, tokenizer = setup.model, setup.tokenizer
    if llm == "llm_r2":
        source = load_file(parts / llm / "model.safetensors")
    else:  # a transformers folder: the source in our names (the import's logits are tested in test_hf_import)
        hf_cfg = json.loads((parts / llm / "config.json").read_text())
        source = map_weights(read_safetensors(parts / llm), hf_cfg.get("tie_word_embeddings", False))
    added = tokenizer.convert_tokens_to_ids(["<image>", "<im_start>", "<im_end>"])
    assert added == [500, 501, 502] and model.config.text_config.vocab_size == 512
    lm = model.language_model.state_dict()
    verified = 0
    for name, tensor in source.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            keep = [i for i in range(tensor.shape[0]) if i not in added]
            assert torch.equal(lm[name][keep], tensor[keep])
            assert torch.allclose(lm[name][added], tensor[:500].mean(0).expand(3, -1), atol=1e-6)
        else:
            assert torch.equal(lm[name], tensor), name
        verified += 1
    vision = model.vision.state_dict()
    for name, tensor in _hf_vision_tensors(parts / vit).items():
        assert torch.equal(vision[f"model.{name}"], tensor), name
        verified += 1
    print(f"{llm} + {vit}: {verified} tensors equal to their sources after assembly")
    assert any(line.startswith(f"[model] language model <- {parts / llm} (") for line in lines), lines
    assert any(line.startswith("[model] projector: new, random init") for line in lines), lines
    assert any("added <image>, <im_start>, <im_end>" in line for line in lines), lines
    # the chat format is the LLM's own, generation stops at its end-of-turn marker
    assert tokenizer.convert_ids_to_tokens(model.config.text_config.eos_token_id) == "<|im_end|>"
    assert model.config.image_token_id == added[0]


@torch.no_grad()
def test_lm_from_a_transformers_folder_keeps_its_logits(parts, tmp_path):
    raw = {"name": "lm", "output_dir": str(tmp_path), "data": {"kind": "synthetic"},
           "model": {"kind": "lm", "preset": str(REPO_ROOT / "configs/model/tiny.yaml"), "llm": str(parts / "qwen2")}}
    ours = setup_model(load_train_config(None, raw=raw), lambda line: None).model.eval()
    ref = T.Qwen2ForCausalLM.from_pretrained(parts / "qwen2", dtype=torch.float32).eval()
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    keep = [i for i in range(512) if i not in (500, 501, 502)]  # the added tokens' rows are new (the mean)
    gap = (ours(ids).logits[..., keep] - ref(ids).logits[..., keep]).abs().max().item()
    assert gap <= 1e-4, gap


def _one_line_exit_2(capsys, argv) -> str:
    from vlm.train import main

    capsys.readouterr()
    assert main(argv) == 2
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: config error: ") and "Traceback" not in stderr, stderr
    return errors[0]  # the callers check its wording; a failing assert shows it


def test_bad_starts_stop_with_one_line(parts, tmp_path, capsys):
    """The five bad cases of a pretrained start (and a foreign model.llm), each one line, exit 2."""
    base = ["--config", str(REPO_ROOT / "configs/train/llava_align.yaml"), f"output_dir={tmp_path}",
            "data.kind=synthetic", "model.tokenizer=null"]
    llm = [f"model.llm={parts / 'llm_r2'}"]
    vit = [f"model.vision.model_name={parts / 'vit'}"]
    err = _one_line_exit_2(capsys, base + vit + ["model.preset=null", f"model.init_from={parts / 'llm'}"])
    assert "model.init_from: " in err and "is a 'olmoe' checkpoint" in err and "model.llm" in err
    err = _one_line_exit_2(capsys, base + vit + [f"model.llm={parts / 'vit'}"])
    assert "model.llm: " in err and "is a 'siglip_vision_model' checkpoint" in err
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (parts / "llm_r2" / name).exists():
            (broken / name).write_bytes((parts / "llm_r2" / name).read_bytes())
    tensors = load_file(parts / "llm_r2" / "model.safetensors")
    tensors.pop("model.norm.weight")
    tensors["model.extra.weight"] = torch.zeros(2)
    from safetensors.torch import save_file
    save_file(tensors, broken / "model.safetensors")
    err = _one_line_exit_2(capsys, base + vit + [f"model.llm={broken}"])
    assert "model.llm: " in err and "model.norm.weight" in err and "model.extra.weight" in err
    err = _one_line_exit_2(capsys, base + vit + llm + ["model.hidden_size=32"])
    assert "model.llm: " in err and "shape mismatch" in err
    err = _one_line_exit_2(capsys, base + llm + ["model.vision.backbone=open_clip", "model.vision.model_name=ViT-B-16",
                                                 "model.vision.pretrained=laion2b_no_such_tag"])
    assert "vision.pretrained" in err and "laion2b_no_such_tag" in err
    err = _one_line_exit_2(capsys, base + llm + ["model.vision.backbone=timm",
                                                 "model.vision.model_name=vit_base_patch16_2244"])
    assert "vision.model_name" in err and "vit_base_patch16_2244" in err
