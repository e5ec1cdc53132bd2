"""Remote code: an export loads with ``trust_remote_code=True`` in a fresh process where ``vlm``,
``vision_encoders`` and ``data_pipelines`` cannot be imported, and generates the same tokens."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from _data_helpers import tiny_tokenizer
from _eval_helpers import build_tiny_vlm

from vlm.remote_code import PACKAGES, closure

BLOCKER = textwrap.dedent("""
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {packages!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
    sys.meta_path.insert(0, Block())
""").format(packages=PACKAGES)


def run_blocked(code: str, tmp_path) -> dict:
    """Run ``code`` in a fresh interpreter with our packages blocked; it prints one JSON line."""
    script = tmp_path / "remote_check.py"
    script.write_text(BLOCKER + textwrap.dedent(code) + textwrap.dedent("""
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in {packages!r})
        assert not leaked, leaked
    """).format(packages=PACKAGES))
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"),
           "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_bundle_has_only_relative_imports_of_our_code():
    files = closure(["vlm.modeling.vlm_model", "vlm.config.vlm", "vlm.modeling.hf"])
    assert "vlm_modeling_vlm_model.py" in files and not any(name.endswith("__init__.py") for name in files)
    for name, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert (node.module or "").split(".")[0] not in PACKAGES, (name, node.module)
            if isinstance(node, ast.ImportFrom) and node.level:
                target = f"{node.module}.py" if node.module else None
                assert target is None or target in files, (name, node.module)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("remote")
    model, processor = build_tiny_vlm(tiny_tokenizer(tmp / "tok"))
    out = tmp / "export"
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return model, processor, out


def test_export_writes_auto_map_and_code(export):
    _, _, out = export
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForImageTextToText"] == \
        "vlm_modeling_vlm_model.ConceptMoEVLMForConditionalGeneration"
    assert config["auto_map"]["AutoConfig"] == "vlm_config_vlm.ConceptMoEVLMConfig"
    assert (out / "vlm_modeling_vlm_model.py").is_file() and (out / "vlm_modeling_generation.py").is_file()


@torch.no_grad()
def test_model_loads_and_generates_without_our_packages(export, tmp_path):
    model, _, out = export
    ids = torch.tensor([[3, 9, 14, 20, 33, 41]])
    ours = model.eval().generate(input_ids=ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    result = run_blocked(f"""
        import json, torch
        from transformers import AutoModelForImageTextToText
        model = AutoModelForImageTextToText.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
        ids = torch.tensor([[3, 9, 14, 20, 33, 41]])
        new = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
        model.save_pretrained({str(tmp_path / "again")!r})  # saving remote code writes the same code again
        print(json.dumps({{"module": type(model).__module__, "tokens": new}}))
    """, tmp_path)
    assert (tmp_path / "again" / "vlm_modeling_vlm_model.py").read_text() == \
        (out / "vlm_modeling_vlm_model.py").read_text()
    assert result["module"].startswith("transformers_modules.") and result["tokens"] == ours


@torch.no_grad()
def test_processor_and_model_answer_an_image_question_without_our_packages(export, tmp_path):
    """AutoProcessor + AutoModelForImageTextToText, both remote code: the same greedy tokens as here."""
    from PIL import Image

    model, processor, out = export
    image = Image.new("RGB", (20, 12), (200, 40, 90))
    image.save(tmp_path / "picture.png")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]
    inputs = processor.apply_chat_template(messages, images=[image], tokenize=True, return_dict=True)
    ours = model.eval().generate(**inputs, max_new_tokens=5, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    result = run_blocked(f"""
        import json, torch
        from PIL import Image
        from transformers import AutoModelForImageTextToText, AutoProcessor
        processor = AutoProcessor.from_pretrained({str(out)!r}, trust_remote_code=True)
        model = AutoModelForImageTextToText.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
        image = Image.open({str(tmp_path / "picture.png")!r}).convert("RGB")
        messages = {messages!r}
        inputs = processor.apply_chat_template(messages, images=[image], tokenize=True, return_dict=True)
        new = model.generate(**inputs, max_new_tokens=5, do_sample=False)[0, inputs["input_ids"].shape[1]:]
        print(json.dumps({{"processor": type(processor).__module__, "tokens": new.tolist(),
                          "ids": inputs["input_ids"][0].tolist()}}))
    """, tmp_path)
    assert result["processor"].startswith("transformers_modules.")
    assert result["ids"] == inputs["input_ids"][0].tolist() and result["tokens"] == ours.tolist()
