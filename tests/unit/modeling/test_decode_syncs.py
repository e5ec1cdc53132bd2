"""Cached decoding reads the device at most once per token and traces without graph breaks (issue 35).

Host reads are counted by test_host_syncs.py's ``HostReads`` (``.item()`` / ``int`` / ``bool``,
``.tolist()``, ``nonzero``, boolean-mask indexing, ...). A decode step of the plain MoE reads
nothing; one of the ConceptMoE reads once (``BOUNDARY_SYNC``: the boundaries choose whether the
concept phase runs). Through ``generate`` (transformers' ``GenerationMixin`` loop over the
ConceptCache), greedy and beam search, batch 1 and 8: per generated token the same, beyond the reads
of transformers' own loop (its stopping check), which are told apart by where they are issued.
``torch._dynamo.explain``: ``decode_step`` of the plain MoE is one graph; the ConceptMoE's phases
are one graph each and its whole step breaks only at the boundary read (bf16: torch's fake
``_grouped_mm`` refuses fp32, so the experts trace in bf16 only).
"""
from __future__ import annotations

import inspect
from collections import Counter
from pathlib import Path

import pytest
import torch

from vlm.modeling import generation
from vlm.modeling.chunking import CONCEPT_SYNC
from vlm.modeling.conceptmoe import HOST_LAYOUT, PROMPT_SYNC
from vlm.modeling.generation import BOUNDARY_SYNC, decode_step
from vlm.modeling.modeling_conceptmoe import ConceptMoEForCausalLM

from _device import dev, require_test_device  # noqa: F401
from conftest import build_model, left_padded, randomise_joint
from test_host_syncs import HostReads

pytestmark = pytest.mark.device

PRESETS = ["tiny", "tiny_concept"]


def _model(preset: str) -> ConceptMoEForCausalLM:
    model = build_model(preset)
    return dev(randomise_joint(model) if model.config.chunking else model)


def _prompt(B: int):
    """Batch 1: no padding (token caches without a key mask); batch 8: row 1 left-padded."""
    ids, am = left_padded(B=max(B, 2), T=12, pad=4)
    return dev(ids[:B], am[:B])


def _loop_site() -> str:
    """Where ``HostReads`` places a read of transformers' own generate loop: the innermost vlm/ line
    on its stack is our ``generate``'s call of ``GenerationMixin.generate``."""
    lines, first = inspect.getsourcelines(ConceptMoEForCausalLM.generate)
    at = first + next(i for i, line in enumerate(lines) if "super().generate(" in line)
    path = Path(inspect.getsourcefile(ConceptMoEForCausalLM)).as_posix()
    return f"vlm/{path.rsplit('/vlm/', 1)[1]}:{at}"


def _per_step(reads: list[tuple[str, str | None, str]]) -> Counter:
    return Counter(why or f"UNNAMED {op} at {at}" for op, why, at in reads)


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("preset", PRESETS)
def test_decode_step_reads_at_most_the_boundaries(preset, B, decode):
    """``prefill`` + ``step`` (the low-level loop): the plain MoE's steps read nothing, the
    ConceptMoE's exactly once each (named); also the fixed-shape step (decode_graph.py, whose
    graphs "compiled" captures), its first step building its buffers included."""
    model = _model(preset)
    ids, am = _prompt(B)
    steps = 6
    with torch.no_grad():
        state = model.start_decoding(B, ids.shape[1] + steps + 1, decode=decode)
        tok = model.prefill(state, ids, attention_mask=am).argmax(-1)
        with HostReads() as hr:
            for _ in range(steps):
                tok = model.step(state, tok).argmax(-1)
    want = Counter({BOUNDARY_SYNC: steps}) if model.config.chunking else Counter()
    assert _per_step(hr.reads) == want


@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("preset", PRESETS)
def test_prefill_reads_only_the_mask_and_the_concept_counts(preset, B):
    """The prefill (the forward on a fresh state; batch 8 left-padded): the attention mask is copied to
    the host once before any kernel (``PROMPT_SYNC``; a copy to the CPU, which the CPU does not make)
    and its padding check and token layout are computed there (``HOST_LAYOUT``, CPU tensors); the
    ConceptMoE reads its concept counts once (``CONCEPT_SYNC``), from which the concept stack's padding
    and layout are built on the host too. Nothing else reads (before: the padding check of each stack
    and the device-built layouts, 15 reads for the padded plain MoE, 31 for the ConceptMoE)."""
    model = _model(preset)
    ids, am = _prompt(B)
    with torch.no_grad():
        state = model.start_decoding(B, ids.shape[1] + 4)
        with HostReads() as hr:
            model.prefill(state, ids, attention_mask=am)
    reads = _per_step([r for r in hr.reads if r[1] != HOST_LAYOUT])
    want = Counter({PROMPT_SYNC: 1} if ids.device.type == "cuda" else {})
    if model.config.chunking:
        want[CONCEPT_SYNC] += 1
    assert reads == want, reads


def _generate_reads(model, ids, am, n: int, beams: int) -> tuple[Counter, int, torch.Tensor]:
    """(our reads by reason, reads of transformers' loop, the output) of one ``generate``."""
    loop = _loop_site()
    with HostReads() as hr:
        out = model.generate(ids, attention_mask=am, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             num_beams=beams)
    ours = _per_step([r for r in hr.reads if r[2] != loop])
    return ours, sum(r[2] == loop for r in hr.reads), out


@pytest.mark.parametrize("beams", [1, 3], ids=["greedy", "beams"])
@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("preset", PRESETS)
def test_generate_reads_at_most_one_per_token(preset, B, beams):
    """Two generations of 3 and 7 new tokens: the 4 extra decoding steps add exactly one named read
    each in our code for the ConceptMoE and none for the plain MoE (the prefill's reads are the
    same in both); transformers' greedy loop adds one per token (its stopping check)."""
    model = _model(preset)
    ids, am = _prompt(B)
    short, loop_short, _ = _generate_reads(model, ids, am, 3, beams)
    long, loop_long, out = _generate_reads(model, ids, am, 7, beams)
    assert out.shape == (B, ids.shape[1] + 7)
    extra = long.copy()
    extra.subtract(short)
    extra = +extra  # (the prefill's reads cancel)
    assert extra == (Counter({BOUNDARY_SYNC: 4}) if model.config.chunking else Counter()), extra
    loop_per_token = (loop_long - loop_short) / 4
    print(f"\n[decode syncs] {preset} batch {B} beams {beams}: our reads per token "
          f"{sum(extra.values()) / 4:.0f}, transformers' loop {loop_per_token:.2f}")
    if beams == 1:
        assert loop_per_token <= 1


# graph breaks -------------------------------------------------------------------------------------------
def _bf16_state(preset: str, B: int = 2):
    model = build_model(preset).to(torch.bfloat16)
    ids, am = left_padded(B=B, T=12, pad=4)
    with torch.no_grad():
        state = model.start_decoding(B, 24)
        tok = model.prefill(state, ids, attention_mask=am).argmax(-1)[:, None]
    return model.model, state, tok


def _explain(fn, *args):
    torch._dynamo.reset()
    with torch.no_grad():
        return torch._dynamo.explain(fn)(*args)


def test_plain_decode_step_is_one_graph():
    ex = _explain(decode_step, *_bf16_state("tiny"))
    assert ex.graph_break_count == 0 and ex.graph_count == 1, [str(r.reason)[:200] for r in ex.break_reasons]


def test_concept_decode_phases_are_one_graph_each():
    """``token_phase``, ``concept_phase`` and ``decoder_phase`` trace without a break; the whole
    ``decode_step`` breaks only at ``boundary_read``."""
    model, state, tok = _bf16_state("tiny_concept")
    for cache in state.concept_caches:
        cache.reserve()
    exs = {"token": _explain(generation.token_phase, model, state, tok)}
    with torch.no_grad():
        x, cos_sin, (b_B, concept_BD, weight_B) = generation.token_phase(model, state, tok)
        b_B = torch.ones_like(b_B)  # every row completes a concept: the concept phase runs for all
        _, lens = generation.boundary_read(b_B, state.concept_caches)
    exs["concept"] = _explain(generation.concept_phase, model, state, concept_BD, weight_B, b_B, max(lens) + 1)
    exs["decoder"] = _explain(generation.decoder_phase, model, state, x, cos_sin)
    for name, ex in exs.items():
        assert ex.graph_break_count == 0, (name, [str(r.reason)[:200] for r in ex.break_reasons])
    model, state, tok = _bf16_state("tiny_concept")
    ex = _explain(decode_step, model, state, tok)
    sites = {(r.user_stack[-1].name if r.user_stack else None) for r in ex.break_reasons}
    assert ex.graph_break_count >= 1 and sites == {"boundary_read"}, [str(r.reason)[:200] for r in ex.break_reasons]
