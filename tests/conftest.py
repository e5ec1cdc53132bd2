"""Shared fixtures for the model tests: tiny fp32 models built from the presets, a decisive router."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from vlm import register_auto_classes  # noqa: E402
from vlm.modeling.configuration_conceptmoe import ConceptMoEConfig  # noqa: E402
from vlm.modeling.modeling_conceptmoe import ConceptMoEForCausalLM  # noqa: E402

PRESETS = ROOT / "configs" / "model"
register_auto_classes()  # `import vlm` alone does not: it stays light for the command lines

# The test models are tiny: intra-op threads only add synchronisation, and on a busy CPU OpenMP
# spin-waiting makes the model tests 10-40x slower. One thread keeps them fast and deterministic.
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _cache_dir_of_the_session(tmp_path_factory):
    """The per-machine cache (the CPU peak of MFU, vlm/training/peak.py) in a session folder, never the
    user's ~/.cache: every in-process run and launched process of the session reads and writes there."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLM_CACHE_DIR", str(tmp_path_factory.mktemp("vlm_cache")))
        mp.delenv("VLM_REMEASURE_PEAK", raising=False)
        yield


@pytest.fixture(scope="module", autouse=True)
def _one_thread_per_file():
    """Every test file starts at the one thread above: the evaluation plugin applies the CPU thread
    policy (all cores, process-wide), which would otherwise hold for every later file of the session."""
    torch.set_num_threads(1)
    yield


@pytest.fixture(autouse=True)
def _seed_fp32():
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float32)
    yield


def build_model(preset: str = "tiny_concept", seed: int = 0, **overrides) -> ConceptMoEForCausalLM:
    """A seeded fp32 model from ``configs/model/<preset>.yaml`` (overrides use dotted or flat keys)."""
    cfg = ConceptMoEConfig.from_yaml(PRESETS / f"{preset}.yaml", **overrides)
    torch.manual_seed(seed)
    return ConceptMoEForCausalLM(cfg).float().eval()


def runtime(model):
    """The ``RuntimeOptions`` a model's ConceptMoE backbone reads (``config.runtime``; a VLM's text config's)."""
    from vlm.modeling.conceptmoe import ConceptMoEModel
    return next(m.cfg for m in model.modules() if isinstance(m, ConceptMoEModel)).runtime


@torch.no_grad()
def decisive(model: ConceptMoEForCausalLM, seed: int = 0) -> ConceptMoEForCausalLM:
    """Set both chunker projections to u u^T (u a random unit vector): cos(q_n, k_{n-1}) = +-1, so
    every router probability is 0 or 1 and hard boundaries cannot flip between two computations."""
    gen = torch.Generator().manual_seed(seed)
    ch = model.model.chunker
    u = torch.randn(ch.q_proj.weight.shape[1], generator=gen)
    u = u / u.norm()
    ch.q_proj.weight.copy_(torch.outer(u, u))
    ch.k_proj.weight.copy_(torch.outer(u, u))
    return model


def left_padded(B: int = 2, T: int = 20, pad: int = 6, seed: int = 1, vocab: int = 2048):
    """Random ids [B, T]; row 1 is left-padded with ``pad`` zeros (attention_mask 0 there)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.long)
    am[1, :pad] = 0
    ids[1, :pad] = 0
    return ids, am


@torch.no_grad()
def randomise_joint(model, std: float = 0.05):
    """Joint projections start at zero; give them weights so that the concept path is exercised."""
    for layer in model.model.layers:
        if layer.attn.joint:
            for lin in (layer.attn.q_c_proj, layer.attn.k_c_proj, layer.attn.v_c_proj):
                lin.weight.normal_(0.0, std)
    return model


@pytest.fixture
def tiny_model():
    """Factory: ``tiny_model(preset="tiny_concept", seed=0, **overrides)``."""
    return build_model


@pytest.fixture
def make_decisive():
    """``make_decisive(model, seed)``: a decisive chunk router (see ``decisive``)."""
    return decisive


def pytest_collection_finish(session):
    """Freeze what importing and collecting made (torch, transformers, lmms-eval, ...: millions of
    long-lived objects) out of the cyclic GC: every later collection, automatic or a benchmark's
    ``gc.collect()``, then walks only what the tests create."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects
def pytest_collection_modifyitems(items):
    """The integration tier: every test under tests/integration/ is marked ``integration`` (pyproject's
    marker; tests/unit/ marks its few by hand), so ``make test-unit`` (``-m "not integration"``) leaves
    them out and ``make test`` runs them after the unit tier."""
    integration = ROOT / "tests" / "integration"
    for item in items:
        if integration in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.integration)


# Test modules import helpers from each other by file name (``from test_generation import fractional``;
# names are unique under tests/): every folder that holds test files is on sys.path, as pytest's prepend
# import mode puts only the importing file's own folder there.
for _folder in sorted({p.parent for p in Path(__file__).resolve().parent.rglob("test_*.py")}):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))
