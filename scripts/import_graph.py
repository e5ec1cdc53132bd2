"""Import graph of our code: module-level and package-level edges, every import counted (also the ones
inside functions), so a function-local import cannot hide a cycle.

    python scripts/import_graph.py            # package -> packages it imports, one line each

A package node is ``vlm.<sub>`` for what lives under ``vlm/`` (``vlm.modeling``, ``vlm.training``, the
top-level modules ``vlm.train`` ...; ``vlm`` itself is ``vlm/__init__.py``) and the top folder otherwise.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("vlm", "vision_encoders", "data_pipelines", "eval_suites", "benchmarks")


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file, for every module of ``PACKAGES``."""
    mods = {}
    for pkg in PACKAGES:
        for path in (root / pkg).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Project modules that ``name`` imports anywhere in its file (``from pkg import sub`` counts as
    importing ``pkg.sub``; ``from pkg import name`` as importing ``pkg``)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in mods and t != name}
    return out


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = modules(root)
    return {name: imports(name, path, mods) for name, path in mods.items()}


def package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "vlm" else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """package -> {imported package: [(importing module, imported module), ...]}."""
    out: dict[str, dict[str, list[tuple[str, str]]]] = {}
    for src, targets in sorted(graph.items()):
        edges = out.setdefault(package_of(src), {})
        for dst in sorted(targets):
            if package_of(dst) != package_of(src):
                edges.setdefault(package_of(dst), []).append((src, dst))
    return out


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    packages = package_graph(module_graph())
    for pkg, edges in sorted(packages.items()):
        print(f"{pkg} -> {', '.join(sorted(edges)) or '-'}")
    cycles = find_cycles({pkg: set(edges) for pkg, edges in packages.items()})
    print("package cycles:", cycles or "none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
