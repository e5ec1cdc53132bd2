"""Host syncs in the training step (issue 17, item 3): MoE dispatch, chunking and dechunk read the
device on the host only at the named points of vlm/modeling/syncs.py.

On the CPU nothing blocks, so ``HostReads`` (a ``TorchDispatchMode``) stands in for the CUDA sync
detector: it records every op that on CUDA makes the host wait for device data (``.item()`` /
``int`` / ``bool`` = ``_local_scalar_dense``, ``.tolist()``, ``nonzero``, boolean-mask indexing,
``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``, copies to the CPU), with
the ``host_sync`` reason it ran under (None = unnamed) and the vlm/ line that issued it. On CUDA,
``torch.cuda.set_sync_debug_mode`` is the ground truth (``cuda_only`` tests at the end).
"""
from __future__ import annotations

import traceback
import warnings
from collections import Counter

import pytest
import torch

from vlm.modeling.configuration_conceptmoe import MoEConfig
from vlm.modeling import syncs
from vlm.modeling.chunking import CONCEPT_SYNC, ChunkModule, ratio_loss
from vlm.modeling.conceptmoe import PAD_SYNC
from vlm.modeling.varlen import LAYOUT_SYNC, LOOP_SYNC, DocLayout
from vlm.modeling.dechunk import dechunk
from vlm.modeling.moe import MoEFeedForward, init_moe_weights

from benchmarks.op_counter import HostReadMode
from _device import DEVICE, cuda_only, dev, require_test_device  # noqa: F401
from conftest import build_model, left_padded

pytestmark = pytest.mark.device

OURS = ("vlm/modeling/moe.py", "vlm/modeling/chunking.py", "vlm/modeling/dechunk.py", "vlm/modeling/blocks.py")


def _where() -> str:
    """The innermost vlm/ line on the stack ("backward" when the autograd engine runs the op)."""
    frames = [f for f in traceback.extract_stack() if "/vlm/" in f.filename]
    return f"vlm/{frames[-1].filename.rsplit('/vlm/', 1)[1]}:{frames[-1].lineno}" if frames else "backward"


class HostReads(HostReadMode):
    """Records (op, host_sync reason or None, where) for every host read of tensor data."""

    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, str | None, str]] = []

    def _read(self, op: str) -> None:
        self.reads.append((op, syncs.active(), _where()))

    def unnamed(self, files=None) -> list[tuple[str, str]]:
        return [(op, at) for op, why, at in self.reads if why is None
                and (files is None or at.split(":")[0] in files or at == "backward")]

    def named(self) -> Counter:
        return Counter(why for _, why, _ in self.reads if why is not None)


def test_detector_sees_host_reads():
    """The detector itself: each kind of host read is recorded, named ones with their reason."""
    t = dev(torch.tensor([1, 2, 3]))
    with HostReads() as hr:
        t.tolist()
        int(t[0])
        bool((t > 1).any())
        t[t > 1]
        torch.nonzero(t)
        with syncs.host_sync("a shape"):
            t.max().item()
        t + 1  # no read
    ops = [op for op, _, _ in hr.reads]
    assert ops == ["tolist", "_local_scalar_dense", "_local_scalar_dense", "index[bool mask]", "nonzero",
                   "_local_scalar_dense"]
    assert hr.named() == Counter({"a shape": 1})


# pieces -------------------------------------------------------------------------------------------
def _moe(shared: int = 0) -> MoEFeedForward:
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=6, top_k=2, moe_intermediate_size=24, shared_expert_intermediate_size=shared)
    moe = MoEFeedForward(32, cfg)
    init_moe_weights(moe, std=0.2)
    return dev(moe)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("shared", [0, 16])
def test_moe_forward_backward_reads_nothing(padded, shared):
    """The sorted dispatch (padding, shared expert, losses, stats) and its backward: no host read."""
    moe = _moe(shared)
    x = dev(torch.randn(2, 9, 32)).requires_grad_()
    valid = dev(torch.ones(2, 9, dtype=torch.bool))
    valid[0, :4] = False
    with HostReads() as hr, syncs.counting() as named:
        y, st = moe(x, valid if padded else None)
        ((y ** 2).sum() + st.lb_loss + st.z_loss).backward()
    assert hr.reads == [] and named == Counter()
    assert x.grad.abs().sum() > 0


def test_moe_loop_reference_does_read():
    """The reference (boolean-mask padding removal, per-expert ``where``) reads: the detector would see
    a dispatch that did the same."""
    moe = _moe()
    moe.dispatch = "loop"
    valid = dev(torch.ones(2, 9, dtype=torch.bool))
    valid[0, :4] = False
    with HostReads() as hr:
        moe(dev(torch.randn(2, 9, 32)), valid)
    assert len(hr.unnamed()) > moe.num_experts


class _ChunkCfg:
    boundary_mode, boundary_noise_tau, target_ratio = "dynamic", 6.0, 2.0
    modality_policy, router_init, image_target_ratio, text_target_ratio = "split_at_switch", "identity", 3.0, 1.5

    def __init__(self, merge):
        self.concept_merge = merge


@pytest.mark.parametrize("merge", ["last", "sum"])
def test_chunking_and_dechunk_read_only_the_concept_count(merge):
    """Boundaries, the ratio loss (per modality), concept formation and dechunk with its backward:
    exactly one host read, the named length M of the concept sequence."""
    ch = dev(ChunkModule(32, _ChunkCfg(merge))).train()
    B, T = 3, 11
    h = dev(torch.randn(B, T, 32)).requires_grad_()
    valid = dev(torch.ones(B, T, dtype=torch.bool))
    valid[1, :3] = False
    valid[2, :] = False  # an empty row
    seg = dev(torch.tensor([[0] * 6 + [1] * 5, [0] * 11, [0] * 11]))
    mod = dev(torch.tensor([[1] * 4 + [0] * 7] * B))
    pos = (valid.long().cumsum(1) - 1).clamp(min=0)
    with HostReads() as hr, syncs.counting() as named:
        b, p = ch.boundaries(h, valid, pos, seg, mod)
        aux = ch.aux_loss(p, b, valid, mod)
        con = ch.form_concepts(h, b, p, valid, seg)
        z, read = dechunk(h, con.x_BMD * 2.0, con.prob_BM, p, b, con.index_BT, merge, con.segment_BM, seg)
        ((z ** 2).sum() + aux + (read ** 2).sum()).backward()
    assert hr.unnamed() == []
    assert named == Counter({CONCEPT_SYNC: 1}) == hr.named()
    assert ratio_loss(p, b, valid & False, 2.0).item() == 0.0  # no real token: 0, without a branch


# the training step --------------------------------------------------------------------------------
def _training_step(preset: str, packed: bool = False, **overrides) -> tuple[HostReads, Counter]:
    model = dev(build_model(preset, **overrides)).train()
    ids, am = dev(*left_padded(B=2, T=24, pad=5))
    labels = ids.masked_fill(am == 0, -100)
    seg = None
    if packed:  # two documents per row, the padding of row 1 kept
        seg = dev(torch.cat([torch.zeros(2, 10, dtype=torch.long), torch.ones(2, 14, dtype=torch.long)], 1))
    with HostReads() as hr, syncs.counting() as named:
        out = model(ids, attention_mask=am, labels=labels, segment_ids=seg)
        out.loss.backward()
    return hr, named


# a DocLayout per stack (tokens, concepts); the CPU loop kernel reads its document runs once more per stack
LOOP = 1 if torch.device(DEVICE).type == "cpu" else 0


@pytest.mark.parametrize("overrides", [{}, {"concept_merge": "sum", "concept_loop_layers": [0],
                                            "concept_loop_times": 2}], ids=["last", "sum-looped"])
def test_training_step_named_syncs(overrides):
    """Forward + backward of the tiny ConceptMoE (padded rows, labels): the named host syncs are
    one per chunking call (the concept count M), one padding check per stack (unpacked rows) and the
    document layouts; MoE (4 layers, looped concept layers included), chunking, dechunk and the
    blocks issue no other read."""
    hr, named = _training_step("tiny_concept", **overrides)
    assert named == Counter({CONCEPT_SYNC: 1, PAD_SYNC: 2, LAYOUT_SYNC: 2}) + Counter({LOOP_SYNC: 2 * LOOP})
    assert hr.named()[CONCEPT_SYNC] == hr.named()[PAD_SYNC] / 2 == 1  # one read each (a layout makes several)
    assert set(hr.named()) == set(named) and hr.unnamed(OURS) == []


def test_packed_training_step_skips_the_padding_check():
    hr, named = _training_step("tiny_concept", packed=True)
    assert named == Counter({CONCEPT_SYNC: 1, LAYOUT_SYNC: 2}) + Counter({LOOP_SYNC: 2 * LOOP}) and set(hr.named()) == set(named)


def test_packed_training_step_with_a_host_layout_reads_no_concept_count(monkeypatch):
    """The trainer's path on a GPU: a packed batch with the collator's host-built token layout. Chunking's
    concept sequence is T slots long (a host bound, runtime.capacity "auto" on a GPU once measured, "tokens" here so
    the CPU runs the same path), so M is never read, and the concept
    stack's layout comes from the token layout and the boundaries on the device (varlen.concept_layout).
    What is left runs on the CPU only: the loop kernel's document runs of the concept layout (a read of a
    CPU tensor, named LOOP_SYNC; the flash kernel on CUDA reads nothing)."""
    from test_host_layout import _packed
    model = dev(build_model("tiny_concept", **{"runtime.capacity": "tokens"})).train()
    batch = {k: dev(v) for k, v in _packed().items()}
    layout = DocLayout.on_host(_packed()["attention_mask"].bool(), _packed()["segment_ids"])  # as the collator does
    with HostReads() as hr, syncs.counting() as named:
        model(**batch, doc_layout=layout).loss.backward()
    assert named[CONCEPT_SYNC] == 0 and hr.named()[CONCEPT_SYNC] == 0, named
    cpu_only = Counter({LOOP_SYNC: 1}) if torch.device(DEVICE).type == "cpu" else Counter()
    assert named == cpu_only and hr.unnamed() == [], (named, hr.unnamed())


def test_plain_moe_training_step_no_named_syncs():
    hr, named = _training_step("tiny")
    assert named == Counter({PAD_SYNC: 1, LAYOUT_SYNC: 1}) + Counter({LOOP_SYNC: LOOP})
    assert hr.unnamed(OURS) == []


def test_whole_training_step_reads_only_at_named_points():
    """Every host read of the whole forward + backward (model, loss, attention, layouts) is named."""
    for packed in (False, True):
        hr, _ = _training_step("tiny_concept", packed=packed)
        assert hr.unnamed() == [], Counter(hr.unnamed())


# CUDA: the real sync detector ---------------------------------------------------------------------
def _sync_warnings(fn) -> list[str]:
    """Runs ``fn`` under ``set_sync_debug_mode("warn")``; the location of every synchronizing op."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


@cuda_only
def test_cuda_moe_bf16_training_has_no_sync():
    """bf16 (the training dtype; ``torch._grouped_mm``): forward + backward of a padded MoE layer run
    under ``set_sync_debug_mode("error")``."""
    moe = _moe(shared=16).to(torch.bfloat16)
    x = dev(torch.randn(2, 64, 32)).bfloat16().requires_grad_()
    valid = dev(torch.ones(2, 64, dtype=torch.bool))
    valid[0, :9] = False
    y, st = moe(x, valid)  # warm-up (lazy CUDA / cuBLAS initialisation)
    ((y.float() ** 2).sum() + st.lb_loss + st.z_loss).backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y, st = moe(x, valid)
        ((y.float() ** 2).sum() + st.lb_loss + st.z_loss).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@cuda_only
@pytest.mark.parametrize("merge", ["last", "sum"])
def test_cuda_chunking_and_dechunk_sync_only_for_the_concept_count(merge):
    """Boundaries, ratio loss, concept formation, dechunk, forward + backward, under
    ``set_sync_debug_mode("error")``: only the named read of M runs (``host_sync`` lifts the mode)."""
    ch = dev(ChunkModule(32, _ChunkCfg(merge))).train()
    h = dev(torch.randn(3, 40, 32)).requires_grad_()
    valid = dev(torch.ones(3, 40, dtype=torch.bool))
    valid[1, :7] = False
    seg = dev((torch.arange(40) >= 25).long()[None].expand(3, 40).contiguous())
    mod = dev((torch.arange(40) < 10).long()[None].expand(3, 40).contiguous())
    pos = (valid.long().cumsum(1) - 1).clamp(min=0)

    def run():
        b, p = ch.boundaries(h, valid, pos, seg, mod)
        con = ch.form_concepts(h, b, p, valid, seg)
        z, _ = dechunk(h, con.x_BMD * 2.0, con.prob_BM, p, b, con.index_BT, merge, con.segment_BM, seg)
        ((z ** 2).sum() + ch.aux_loss(p, b, valid, mod)).backward()
    run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with syncs.counting() as named:
            run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert named == Counter({CONCEPT_SYNC: 1})


@cuda_only
def test_cuda_training_step_forward_syncs_not_in_owned_code():
    """The whole bf16 training step under ``set_sync_debug_mode("warn")``: the named chunking sync
    does not warn, and no forward warning points into moe / chunking / dechunk / blocks (backward
    warnings point into torch.autograd, so the isolated tests above cover the backward)."""
    model = dev(build_model("tiny_concept")).to(torch.bfloat16).train()
    ids, am = dev(*left_padded(B=2, T=64, pad=5))
    labels = ids.masked_fill(am == 0, -100)

    def step():
        model(ids, attention_mask=am, labels=labels).loss.backward()
    step()
    with syncs.counting() as named:
        where = _sync_warnings(step)
    assert named == Counter({CONCEPT_SYNC: 1, PAD_SYNC: 2, LAYOUT_SYNC: 2})
    assert [w for w in where if any(f in w for f in OURS)] == [], where


@cuda_only
def test_cuda_packed_step_with_a_host_layout_forward_syncs_nowhere_in_owned_code():
    """The trainer's path on CUDA in bf16 (flash varlen for both stacks): no named sync at all (the concept
    count is not read, the concept layout is built on the device with a host max_len), and no forward
    warning of ``set_sync_debug_mode("warn")`` points into the model's code."""
    from test_host_layout import _packed
    model = dev(build_model("tiny_concept")).to(torch.bfloat16).train()
    host = _packed(T=96)
    layout = DocLayout.build(host["attention_mask"].bool(), host["segment_ids"])
    batch = {k: dev(v) for k, v in host.items()}

    def step():
        model(**batch, doc_layout=layout).loss.backward()
    step()
    with syncs.counting() as named:
        where = _sync_warnings(step)
    assert named == Counter()
    owned = OURS + ("vlm/modeling/varlen.py", "vlm/modeling/conceptmoe.py", "vlm/modeling/attention.py")
    assert [w for w in where if any(f in w for f in owned)] == [], where
