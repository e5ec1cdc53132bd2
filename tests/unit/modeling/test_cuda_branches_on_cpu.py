"""The model's CUDA branches on the CPU (issue 39, item 2; the harness: tests/_cuda_on_cpu.py): flash varlen
through a stand-in of torch's ``varlen_attn``, the Triton EMA scan interpreted, the concept sequence at its
capacity T, the collator's host layout, bf16 as on a GPU.

- the stand-in is torch's signature and attention: equal to the CPU loop kernel, zero-length documents
  included, and it refuses what flash refuses;
- ``train.compile``'s ``compile_blocks`` (fullgraph) traces every block on these branches, and the packed
  training step's loss and gradients equal eager's (finding 2 of issue 39: a log call inside the traced
  flash path stopped the trace); the flash path's log line still comes once per process;
- the packed training step on these branches gives the CPU branches' loss and gradients, and reads the
  device 0 times;
- the captured decode (``decode="cudagraph"``) under ``CaptureRules``: no host read, no replaced buffer,
  no fp32 grouped GEMM during capture; each rule fails a step that breaks it.
"""
from __future__ import annotations

import copy
import inspect
import logging
import sys
from collections import Counter

import pytest
import torch
from _cuda_on_cpu import (
    CaptureError,
    CaptureRules,
    cuda_branches,
    flash_standin,
    host_layout,
)
from conftest import build_model, decisive, left_padded, randomise_joint
from test_host_layout import _packed
from test_host_syncs import HostReads

from vlm.modeling import decode_graph, features, generation, syncs, varlen
from vlm.modeling.cache import ConceptCache
from vlm.modeling.hf_features import generation_cache_key
from vlm.training.compile import compile_blocks

BF16 = {"atol": 2e-2, "rtol": 2e-2}  # one computation in bf16 against another (summation order differs)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _qkv(N: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(N, h, 16, generator=g).bfloat16() for h in (4, 2, 2)]


def test_standin_has_torchs_signature_and_attention():
    """Same parameters as torch's ``varlen_attn`` (``features.varlen_api`` detects the same API); through
    ``varlen_call`` it equals the CPU loop kernel over a layout with padding and interleaved documents, and
    over a concept layout with zero-length documents."""
    from torch.nn.attention.varlen import varlen_attn
    assert inspect.signature(flash_standin).parameters.keys() == inspect.signature(varlen_attn).parameters.keys()
    P = -1
    seg = torch.tensor([[1, 1, 1, 2, 2, P, P, 3, 3, 3, 3, 3], [1, 2, 1, 2, 1, 2, 1, 2, P, P, P, P]])
    layout = varlen.DocLayout.build(seg != P, seg.clamp(min=0))
    b_BT = torch.tensor([[1, 0, 1, 1, 0, 1, 0, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    tseg = torch.tensor([[1, 1, 1, 2, 2, 3, 3, 3, 3, 3, P, P], [1] * 8 + [P] * 4])  # (rows in order: concept_layout applies)
    clayout = varlen.concept_layout(varlen.DocLayout.build(tseg != P, tseg.clamp(min=0)), b_BT)
    assert (clayout.cu_seq.diff() == 0).any()  # zero-length documents
    for lay in (layout, clayout):
        q, k, v = (x.reshape(2, 12, -1, 16).transpose(1, 2) for x in _qkv(24))
        want = varlen._loop(q.float(), k.float(), v.float(), lay)
        with cuda_branches(triton=False):
            got = varlen.doc_attention(q, k, v, lay, "cuda")
        torch.testing.assert_close(got.float(), want, **BF16)


def test_the_seams_take_cudas_branches_on_the_cpu():
    """``runtime.varlen_kernel = "cuda"``: flash in bf16 (head_dim a multiple of 8), CUDA's bucketed kernel in
    fp32, where "auto" takes the loop kernel on the CPU; ``cuda_branches`` sets the model's choices and puts
    them back."""
    from conftest import runtime
    cpu = torch.device("cpu")
    assert varlen.kernel_for(cpu, torch.bfloat16, 16) == "loop"
    with cuda_branches(triton=False):
        cases = ((torch.bfloat16, 16), (torch.float32, 16), (torch.bfloat16, 12))
        assert [varlen.kernel_for(cpu, dt, d, "cuda") for dt, d in cases] == ["flash", "bucketed", "bucketed"]
    model = build_model("tiny_concept")
    with cuda_branches(model):
        opts = runtime(model)
        assert (opts.varlen_kernel, opts.capacity, opts.ema_scan) == ("cuda", "tokens", "triton")
    assert (opts.varlen_kernel, opts.capacity, opts.ema_scan) == ("auto", "auto", "auto")


@pytest.mark.parametrize("bad", ["fp32", "int64 cu_seq", "tensor max_len", "strided", "heads", "max_len short"])
def test_standin_refuses_what_flash_refuses(bad):
    q, k, v = _qkv(8)
    cu, n = torch.tensor([0, 3, 8], dtype=torch.int32), 5
    kw = {"window_size": (-1, 0), "enable_gqa": True}
    if bad == "fp32":
        q, k, v = q.float(), k.float(), v.float()
    elif bad == "int64 cu_seq":
        cu = cu.long()
    elif bad == "tensor max_len":
        n = torch.tensor(5)
    elif bad == "strided":
        q = torch.randn(8, 4, 32).bfloat16()[..., ::2]
    elif bad == "heads":
        kw["enable_gqa"] = False
    else:
        n = 4
    with pytest.raises((RuntimeError, TypeError, ValueError)):
        flash_standin(q, k, v, cu, cu, n, n, **kw)
    flash_standin(*_qkv(8), torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 3, 8], dtype=torch.int32),
                  5, 5, window_size=(-1, 0), enable_gqa=True)  # the good call passes


def _bf16_model():
    """The tiny ConceptMoE in bf16, training mode, its router decisive (p 0 or 1: the sampled boundaries
    cannot flip between two computations that differ in the last bits)."""
    return decisive(build_model("tiny_concept"), 3).to(torch.bfloat16).train()


def _step(model, batch, layout):
    torch.manual_seed(0)  # (the boundary sampling)
    out = model(**batch, doc_layout=layout)
    out.loss.backward()
    return [out.loss.detach()] + [p.grad for p in model.parameters()]


def test_compiled_blocks_train_equal_eager_on_the_cuda_branches(monkeypatch):
    """``compile_blocks`` (fullgraph, aot_eager: the forward and backward graphs) on the ConceptMoE in bf16,
    a packed batch with the collator's layout (padding; the concept stack at capacity T, its layout with
    zero-length documents), as the first step of the process (nothing logged yet): every block traces on
    the flash path, and the loss and every gradient equal the eager model's (bf16: each gradient to 2% of
    its norm). Before the fix the trace stopped in ``features._say``: "Unsupported: logging.Logger method
    not supported for non-export cases"."""
    monkeypatch.setattr(features, "_logged", set())
    batch = _packed()
    layout = host_layout(batch)
    eager = _bf16_model()
    compiled = copy.deepcopy(eager)
    assert compile_blocks(compiled, dtype=torch.bfloat16, backend="aot_eager") == 4
    calls = []
    with cuda_branches(compiled, eager):
        got = _step(compiled, batch, layout)
        real = varlen.varlen_call

        def spy(q, k, v, cu, n):
            calls.append(cu)
            return real(q, k, v, cu, n)
        monkeypatch.setattr(varlen, "varlen_call", spy)
        want = _step(eager, batch, layout)
    assert len(calls) == 4 and any((cu.diff() == 0).any() for cu in calls)  # every layer on flash; empty documents
    torch.testing.assert_close(got[0].float(), want[0].float(), **BF16)
    for i, (w, g) in enumerate(zip(want[1:], got[1:])):
        assert w is not None and g is not None, i
        assert (g.float() - w.float()).norm() <= 2e-2 * w.float().norm(), i


@pytest.mark.parametrize("T", [24, 41])
def test_cuda_branches_train_the_cpu_branches_model(T):
    """The packed step on the CUDA branches (flash, the concept sequence at capacity T with its layout from
    the host's, zero-length and 64-slot tail documents, the Triton EMA) and on the CPU's (loop kernel, the
    concept count read, the torch scan): the same loss and gradients, to bf16 rounding (5% of each
    gradient's norm; measured <= 1.8%)."""
    from test_compile_blocks import packed_batch

    from conftest import runtime
    batch = _packed() if T == 24 else packed_batch(T, seed=5)
    layout = host_layout(batch)
    cpu = _bf16_model()
    cuda = copy.deepcopy(cpu)
    runtime(cpu).capacity = "exact"
    want = _step(cpu, batch, layout)
    with cuda_branches(cuda):
        got = _step(cuda, batch, layout)
    torch.testing.assert_close(got[0].float(), want[0].float(), **BF16)
    for i, (w, g) in enumerate(zip(want[1:], got[1:])):
        assert (g.float() - w.float()).norm() <= 5e-2 * w.float().norm(), i


def test_flash_path_reuses_the_block_graphs_over_packings():
    """Six packings of other lengths (and longest documents: ``max_len``, a host int handed to flash) on the
    CUDA branches: every block graph is made in the first two steps, none after (Dynamo only)."""
    from test_compile_blocks import packed_batch
    from torch._dynamo.testing import CompileCounter
    model = _bf16_model()
    counter = CompileCounter()
    compile_blocks(model, dtype=torch.bfloat16, backend=counter)
    frames = []
    with cuda_branches(model, triton=False):
        for step in range(6):
            batch = packed_batch(20 + 3 * step, seed=step)
            model(**batch, doc_layout=host_layout(batch)).loss.backward()
            frames.append(counter.frame_count)
    assert frames[1] > 0 and frames[-1] == frames[1], frames


def test_flash_path_logs_its_api_once(caplog, monkeypatch):
    """The varlen API line: once per process in an eager run (two steps), and once in a compiled run
    (said before the trace: a log call cannot be traced)."""
    monkeypatch.setattr(features, "_logged", set())
    batch = _packed()
    layout = host_layout(batch)
    model = _bf16_model()
    with caplog.at_level(logging.INFO, logger="vlm.features"), cuda_branches(model, triton=False):
        for _ in range(2):
            model(**batch, doc_layout=layout).loss.backward()
        eager = [r.getMessage() for r in caplog.records if "varlen_attn(" in r.getMessage()]
        features._logged.clear()
        caplog.clear()
        compile_blocks(model, dtype=torch.bfloat16, backend="eager")
        model(**batch, doc_layout=layout).loss.backward()
        compiled = [r.getMessage() for r in caplog.records if "varlen_attn(" in r.getMessage()]
    assert len(eager) == 1 and compiled == eager, (eager, compiled)


def test_packed_training_step_reads_nothing_on_the_cuda_branches():
    """The trainer's step on the GPU paths (flash for both stacks, capacity T, the host layout, the Triton
    EMA forward and backward): no host read at all, named or not."""
    batch = _packed()
    layout = host_layout(batch)
    model = _bf16_model()
    with cuda_branches(model), pytest.MonkeyPatch.context() as mp:
        model(**batch, doc_layout=layout).loss.backward()  # warm-up (one-time probes)
        kernel, scans = sys.modules["vlm.modeling.linear_scan_triton"], []
        mp.setattr(kernel, "scan", lambda *a, _scan=kernel.scan, **k: scans.append(1) or _scan(*a, **k))
        with HostReads() as hr, syncs.counting() as named:
            model(**batch, doc_layout=layout).loss.backward()
    assert named == Counter() and hr.reads == [], (named, hr.reads)
    assert len(scans) == 2  # the EMA forward and backward on the Triton kernels


# the captured decode --------------------------------------------------------------------------------
def _cudagraph_generate(model, monkeypatch, **kw):
    monkeypatch.setattr(decode_graph, "warm_up", lambda run: run())
    monkeypatch.setattr(decode_graph, "capture", CaptureRules)
    monkeypatch.setattr(generation, "check_decode", lambda decode, device=None, dtype=None: decode)  # (CUDA only otherwise)
    monkeypatch.setattr(CaptureRules, "captures", 0)
    ids, am = left_padded(B=2, T=12, pad=4)
    cache = ConceptCache(12 + 9, decode="cudagraph")
    with cuda_branches(model, triton=False):
        got = model.generate(ids, attention_mask=am, do_sample=False, max_new_tokens=8,
                             **{generation_cache_key(): cache}, **kw)
        want = model.generate(ids, attention_mask=am, do_sample=False, max_new_tokens=8, **kw)
    return got, want


@pytest.mark.parametrize("beams", [1, 2])
def test_captured_decode_keeps_the_capture_rules(beams, monkeypatch):
    """bf16 ConceptMoE, greedy and beam search: every phase graph captured under the rules (no host read,
    no buffer replaced, no fp32 grouped GEMM) and the tokens equal the eager decode's."""
    model = decisive(randomise_joint(build_model("tiny_concept")), 3).to(torch.bfloat16)
    got, want = _cudagraph_generate(model, monkeypatch, num_beams=beams)
    assert torch.equal(got, want) and CaptureRules.captures == 3


@pytest.mark.parametrize("broken", ["fp32", "host read", "host copy", "replaced buffer"])
def test_capture_rules_fail_a_step_that_breaks_them(broken, monkeypatch):
    """Each rule fails the capture of a step that breaks it: the fp32 model (its grouped GEMM in fp32: on
    CUDA the split fallback and its host read), a ``.item()`` planted in the decoder phase, the
    decoder phase's output buffer replaced by a new tensor; a ``.cpu()`` too (on the CPU a no-op)."""
    model = decisive(randomise_joint(build_model("tiny_concept")), 3)
    if broken != "fp32":
        model = model.to(torch.bfloat16)
    graph = decode_graph.decoder_graph

    def planted(m, state, io):
        graph(m, state, io)
        if broken == "host read":
            io["out"].sum().item()
        elif broken == "host copy":
            io["out"].cpu()
        else:
            io["out"] = io["out"].clone()
    if broken != "fp32":
        monkeypatch.setattr(decode_graph, "decoder_graph", planted)
    match = {"fp32": "grouped_mm in fp32", "host read": "host read", "host copy": r"host copy \.cpu",
             "replaced buffer": "replaced"}[broken]
    with pytest.raises(CaptureError, match=match):
        _cudagraph_generate(model, monkeypatch)
