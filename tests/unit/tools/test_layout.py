"""House rules of the package code: no import cycle between project modules nor between packages (every
import counts, lazy ones too), a flat self-contained model package, each package importable first in a fresh
interpreter, no package file over 400 lines."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.import_graph import PACKAGES, find_cycles, module_graph, modules, package_graph

ROOT = Path(__file__).resolve().parents[3]
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    return modules(ROOT)


# Package edges that close a cycle and that only a restructuring elsewhere removes: (importer, imported) -> why.
# Empty: the package graph is a DAG.
ALLOWED_PACKAGE_CYCLE_EDGES: dict[tuple[str, str], str] = {}
MODEL_PACKAGE = "vlm.modeling"


def test_no_import_cycles():
    graph = module_graph(ROOT)
    assert sum(map(len, graph.values())) > 50  # the walk sees the real imports
    assert find_cycles(graph) == []


def test_packages_form_a_dag():
    """vlm.modeling, vlm.config, vlm.training, ..., vision_encoders, data_pipelines, eval_suites: no cycle
    between packages, counting every import (function-local ones too)."""
    packages = package_graph(module_graph(ROOT))
    assert {"vlm.modeling", "vlm.training", "vision_encoders", "data_pipelines", "eval_suites"} <= set(packages)
    graph = {pkg: {dst for dst in edges if (pkg, dst) not in ALLOWED_PACKAGE_CYCLE_EDGES}
             for pkg, edges in packages.items()}
    assert find_cycles(graph) == []


def test_the_model_package_is_flat_and_self_contained():
    """The model package (what an export carries as its code) imports nothing of ours outside itself, and only
    with ``from .module import ...``: transformers' remote code follows those, within one folder."""
    folder = ROOT / MODEL_PACKAGE.replace(".", "/")
    assert not [p for p in folder.iterdir() if p.is_dir() and p.name != "__pycache__"]
    outside = {(src, dst) for src, dsts in module_graph(ROOT).items() if src.startswith(MODEL_PACKAGE + ".")
               for dst in dsts if not dst.startswith(MODEL_PACKAGE + ".")}
    assert outside == set()
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and (node.module is None or (folder / f"{node.module}.py").is_file()), \
                    (path.name, node.module)
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not {n.split(".")[0] for n in names} & set(PACKAGES), (path.name, names)


def test_model_package_check_catches_an_import_from_outside(tmp_path):
    """The graph sees a function-local import of ours (the rule above would fail on it)."""
    (tmp_path / "vlm" / "modeling").mkdir(parents=True)
    (tmp_path / "vlm" / "__init__.py").write_text("")
    (tmp_path / "vlm" / "modeling" / "__init__.py").write_text("")
    (tmp_path / "vlm" / "modeling" / "m.py").write_text("def f():\n    from vlm.training import x\n")
    (tmp_path / "vlm" / "training.py").write_text("import vlm.modeling.m\n")
    graph = module_graph(tmp_path)
    assert graph["vlm.modeling.m"] == {"vlm.training"}
    assert find_cycles({k: set(v) for k, v in package_graph(graph).items()}) == [["vlm.modeling", "vlm.training"]]


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_package_files_are_short():
    long = {str(p.relative_to(ROOT)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.integration  # a fresh interpreter per package
def test_each_package_imports_first(package):
    """Imported first in a fresh interpreter (then every module of it): a cycle through a package's
    ``__init__`` (which the graph above does not model) fails here."""
    mods = sorted(m for m, p in _modules().items() if m.split(".")[0] == package and p.stem != "__main__"
                  and (p.parent / "__init__.py").is_file())
    code = f"import importlib\nfor m in {mods!r}:\n    importlib.import_module(m)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
