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

PACKAGES = ("vlm", "vision_encoders", "data_pipelines")

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


def test_the_export_has_only_relative_imports_of_our_code(export):
    _, _, out = export
    files = {path.name: path.read_text() for path in out.glob("*.py")}
    assert "modeling_conceptmoe_vl.py" in files and not any(name.endswith("__init__.py") for name in files)
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
        "modeling_conceptmoe_vl.ConceptMoEVLMForConditionalGeneration"
    assert config["auto_map"]["AutoConfig"] == "configuration_conceptmoe_vl.ConceptMoEVLMConfig"
    assert config["auto_map"]["AutoModel"] == config["auto_map"]["AutoModelForImageTextToText"]
    assert (out / "modeling_conceptmoe_vl.py").is_file() and (out / "generation.py").is_file()


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
    assert (tmp_path / "again" / "modeling_conceptmoe_vl.py").read_text() == \
        (out / "modeling_conceptmoe_vl.py").read_text()
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


def test_export_loads_without_the_optional_tower_libraries(export):
    """transformers' check_imports needs every library a file imports outside try blocks: timm and open_clip
    are needed only by the towers that use them (an export with a transformers tower loads without them)."""
    from transformers.dynamic_module_utils import get_imports

    _, _, out = export
    needed = {name for path in out.glob("*.py") for name in get_imports(path)}
    assert "torch" in needed and not needed & {"timm", "open_clip"}, sorted(needed)


@torch.no_grad()
def test_language_model_export_loads_and_generates_without_our_packages(tmp_path):
    """The LM alone: its export carries the language model's files only (no vision tower, no processor)."""
    from pathlib import Path

    from vlm.modeling.configuration_conceptmoe import ConceptMoEConfig
    from vlm.modeling.modeling_conceptmoe import ConceptMoEForCausalLM

    torch.manual_seed(0)
    config = ConceptMoEConfig.from_yaml(Path(__file__).resolve().parents[3] / "configs/model/tiny_concept.yaml")
    model = ConceptMoEForCausalLM(config).eval()
    out = tmp_path / "lm"
    model.save_pretrained(out)
    code = sorted(p.name for p in out.glob("*.py"))
    assert "modeling_conceptmoe.py" in code and not [n for n in code if n.startswith(("vision_", "processing_"))]
    ids = torch.tensor([[3, 9, 14, 20, 33, 41]])
    ours = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    result = run_blocked(f"""
        import json, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
        ids = torch.tensor([[3, 9, 14, 20, 33, 41]])
        new = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
        print(json.dumps({{"module": type(model).__module__, "tokens": new}}))
    """, tmp_path)
    assert result["module"].startswith("transformers_modules.") and result["tokens"] == ours
