"""Remote code: an export that loads with ``trust_remote_code=True`` where our packages are not installed.

transformers loads remote code as one flat folder of modules joined by relative imports
(``dynamic_module_utils``), so ``write_remote_code`` copies the closure of the entry modules (our
imports followed statically, across ``vlm``, ``vision_encoders`` and ``data_pipelines``) into the
export under flat names (``vlm/modeling/hf.py`` -> ``vlm_modeling_hf.py``), with every import of our
packages rewritten to a relative one that names the module defining the object (package
``__init__`` files are never copied), and writes ``auto_map`` into the saved JSON files.
"""
from __future__ import annotations

import ast
import json
from functools import lru_cache
from pathlib import Path

PACKAGES = ("vlm", "vision_encoders", "data_pipelines")
ROOT = Path(__file__).resolve().parents[1]
MODEL_AUTO_MAP = {  # auto class -> (module, class)
    "conceptmoe_vlm": {"AutoConfig": ("vlm.config.vlm", "ConceptMoEVLMConfig"),
                       "AutoModel": ("vlm.modeling.vlm_model", "ConceptMoEVLMForConditionalGeneration"),
                       "AutoModelForImageTextToText": ("vlm.modeling.vlm_model",
                                                       "ConceptMoEVLMForConditionalGeneration")},
    "conceptmoe": {"AutoConfig": ("vlm.config.model", "ConceptMoEConfig"),
                   "AutoModelForCausalLM": ("vlm.modeling.hf", "ConceptMoEForCausalLM")},
}


def flat_name(module: str) -> str:
    return module.replace(".", "_")


def module_file(module: str) -> Path | None:
    """The source file of one of our modules (a package's ``__init__.py``), or None."""
    if module.split(".")[0] not in PACKAGES:
        return None
    base = ROOT.joinpath(*module.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return base / "__init__.py" if (base / "__init__.py").is_file() else None


def is_package(module: str) -> bool:
    path = module_file(module)
    return path is not None and path.name == "__init__.py"


def _absolute(node: ast.ImportFrom, module: str) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package(module) else module.split(".")[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


@lru_cache(maxsize=None)
def _top_level_names(path: Path) -> dict[str, str | None]:
    """Names a module binds at top level: name -> None (defined here) or the module it imports it from."""
    tree, module = ast.parse(path.read_text(encoding="utf-8")), _module_of(path)
    names: dict[str, str | None] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = None
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names.setdefault(leaf.id, None)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, module)
            for alias in node.names:
                names.setdefault(alias.asname or alias.name, f"{source}.{alias.name}")
    return names


def _module_of(path: Path) -> str:
    rel = path.resolve().relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def defining_module(module: str, name: str) -> tuple[str, bool]:
    """(module, is_module): where ``from <module> import <name>`` really lives, following re-exports
    through package ``__init__`` files (and a lazy ``_EXPORTS`` map such as data_pipelines')."""
    sub = f"{module}.{name}"
    if module_file(sub) is not None:
        return sub, True
    path = module_file(module)
    names = _top_level_names(path)
    if names.get(name, "missing") is None and not is_package(module):
        return module, False
    target = names.get(name)
    if target is None or target == "missing":
        lazy = _lazy_exports(path)
        if name in lazy:
            return defining_module(_absolute_lazy(module, lazy[name]), name)
        if names.get(name) is None and name in names:
            return module, False
        raise ImportError(f"remote code: cannot find where {module}.{name} is defined")
    source, _, attr = target.rpartition(".")
    return defining_module(source, attr)


@lru_cache(maxsize=None)
def _lazy_exports(path: Path) -> dict[str, str]:
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def _absolute_lazy(package: str, relative: str) -> str:
    return f"{package}.{relative.lstrip('.')}"


def rewrite(module: str) -> tuple[str, set[str]]:
    """The module's source with our imports made flat and relative, and the modules it needs."""
    path = module_file(module)
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines(keepends=True)
    edits, needed = [], set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            target = _absolute(node, module)
            if target.split(".")[0] not in PACKAGES:
                continue
            groups: dict[str, list[str]] = {}
            modules = []
            for alias in node.names:
                where, is_mod = defining_module(target, alias.name)
                needed.add(where)
                bind = alias.asname or alias.name
                if is_mod:
                    modules.append(f"from . import {flat_name(where)} as {bind}")
                else:
                    groups.setdefault(where, []).append(alias.name + (f" as {bind}" if bind != alias.name else ""))
            parts = [f"from .{flat_name(where)} import {', '.join(names)}" for where, names in groups.items()]
            edits.append((node, "; ".join(parts + modules)))
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] in PACKAGES for a in node.names):
            raise ImportError(f"remote code: {module} uses 'import {node.names[0].name}'; use 'from ... import ...'")
    for node, text in sorted(edits, key=lambda e: (e[0].lineno, e[0].col_offset), reverse=True):
        first, last = node.lineno - 1, node.end_lineno - 1
        head, tail = lines[first][:node.col_offset], lines[last][node.end_col_offset:]
        lines[first:last + 1] = [head + text + tail]
    return "".join(lines), needed


def closure(entries) -> dict[str, str]:
    """flat file name -> rewritten source, for the entry modules and everything they import."""
    todo, files, seen = list(entries), {}, set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        text, needed = rewrite(module)
        name = flat_name(module) + ".py"
        if name in files:
            raise ImportError(f"remote code: two modules flatten to {name}")
        files[name] = text
        todo.extend(needed - seen)
    return files


PROCESSOR_AUTO_MAP = {"AutoProcessor": ("vlm.processing", "ConceptMoEVLMProcessor")}


def write_remote_code(folder, auto_maps: dict) -> list[str]:
    """Copy the code the ``auto_maps`` name into ``folder`` and write each map into its JSON file:
    ``{"config.json": MODEL_AUTO_MAP[model_type], ...}``. Returns the written code file names."""
    folder = Path(folder)
    entries = {module for spec in auto_maps.values() for module, _ in spec.values()}
    if __name__ == "vlm.remote_code":
        files = closure(sorted(entries))
    else:  # running as remote code itself: this folder already holds the flat modules
        here = Path(__file__).resolve().parent
        files = {path.name: path.read_text(encoding="utf-8") for path in here.glob("*.py") if path.name != "__init__.py"}
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    for json_name, spec in auto_maps.items():
        _add_auto_map(folder / json_name, spec)
    return sorted(files)


def _add_auto_map(path: Path, spec: dict) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data["auto_map"] = {**data.get("auto_map", {}),
                        **{auto: f"{flat_name(module)}.{cls}" for auto, (module, cls) in spec.items()}}
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
