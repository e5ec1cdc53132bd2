"""Chunked cross entropy (issue 17, item 4): ``chunked_lm_loss`` == the full-logits ``lm_loss_fn``
(loss and gradients, fp32, max |diff| <= 1e-5), the model's loss-only forward (``return_logits=False``
/ ``loss_only``) == the forward with logits, no host read, and a lower peak memory for a long row with
a big vocabulary (CPU allocations counted with torch.profiler)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from vlm.modeling.modeling_conceptmoe import chunked_lm_loss, lm_loss_fn, loss_only

from conftest import build_model, left_padded
from test_host_syncs import HostReads

TOL = 1e-5


def _grads(fn, *leaves):
    for t in leaves:
        t.grad = None
    loss = fn()
    loss.backward()
    return loss.detach(), [t.grad.clone() for t in leaves]


def _maxdiff(a, b) -> float:
    return float((a - b).detach().abs().max())


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000], ids=lambda c: f"chunk{c}")
def test_chunked_equals_full_logits_loss_and_grads(chunk):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 301, bias=False)
    h = torch.randn(3, 25, 16, requires_grad=True)
    labels = torch.randint(0, 301, (3, 25))
    labels[0, :9] = -100
    labels[2, 20:] = -100
    ref, ref_g = _grads(lambda: lm_loss_fn(head(h), labels), h, head.weight)
    got, got_g = _grads(lambda: chunked_lm_loss(head, h, labels, chunk_tokens=chunk), h, head.weight)
    assert _maxdiff(got, ref) <= TOL
    for g, r in zip(got_g, ref_g):
        assert _maxdiff(g, r) <= TOL


def _sliced_reference(logits_BTV, labels_BT):
    """The textbook next-token loss: logits[:, :-1] against labels[:, 1:]."""
    lg = logits_BTV[:, :-1].float()
    lab = labels_BT[:, 1:]
    return F.cross_entropy(lg.reshape(-1, lg.shape[-1]), lab.reshape(-1), ignore_index=-100, reduction="sum") \
        / (lab != -100).sum().clamp(min=1)


def test_shifted_labels_equal_the_sliced_reference():
    """Issue 27 item 1: shifting the labels (instead of slicing the logits) leaves the loss and the
    gradients of the logits, the hidden states and the head unchanged (fp32, <= 1e-6)."""
    torch.manual_seed(1)
    head = torch.nn.Linear(16, 301, bias=False)
    h = torch.randn(3, 25, 16, requires_grad=True)
    labels = torch.randint(0, 301, (3, 25))
    labels[1, :4] = -100
    labels[2, -1] = -100
    ref, ref_g = _grads(lambda: _sliced_reference(head(h), labels), h, head.weight)
    for fn in (lambda: lm_loss_fn(head(h), labels), lambda: chunked_lm_loss(head, h, labels, chunk_tokens=7)):
        got, got_g = _grads(fn, h, head.weight)
        assert _maxdiff(got, ref) <= 1e-6
        for g, r in zip(got_g, ref_g):
            assert _maxdiff(g, r) <= 1e-6


def _graph_ops(t: torch.Tensor) -> set:
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


def test_losses_never_slice_or_copy_the_logits():
    """Issue 27 item 1: no slice (its backward zero-fills a full-size gradient and copies into it) and
    no copy of the [B, T, V] logits / [B, T, D] hidden states between them and the loss."""
    logits = torch.randn(2, 9, 50, requires_grad=True)
    hidden = torch.randn(2, 9, 8, requires_grad=True)
    head = torch.nn.Linear(8, 50, bias=False)
    labels = torch.randint(0, 50, (2, 9))
    for loss in (lm_loss_fn(logits, labels), chunked_lm_loss(head, hidden, labels, chunk_tokens=100)):
        ops = _graph_ops(loss)
        assert not ops & {"SliceBackward0", "CloneBackward0", "CopyBackwards", "UnsafeViewBackward0"}, ops


def test_no_labels_left_is_zero_with_zero_grads():
    head = torch.nn.Linear(8, 50, bias=False)
    h = torch.randn(2, 6, 8, requires_grad=True)
    labels = torch.full((2, 6), -100)
    for fn in (lambda: lm_loss_fn(head(h), labels), lambda: chunked_lm_loss(head, h, labels, chunk_tokens=4)):
        loss, (gh, gw) = _grads(fn, h, head.weight)
        assert loss.item() == 0.0 and not gh.any() and not gw.any()


def test_losses_read_nothing_on_the_host():
    """The old ``bool((labels != -100).any())`` is gone: the count is a where / clamp on the device."""
    head = torch.nn.Linear(8, 50, bias=False)
    h = torch.randn(2, 6, 8, requires_grad=True)
    labels = torch.randint(0, 50, (2, 6))
    with HostReads() as hr:
        lm_loss_fn(head(h), labels).backward()
        chunked_lm_loss(head, h, labels, chunk_tokens=5).backward()
    assert hr.reads == []


@pytest.mark.parametrize("preset", ["tiny", "tiny_concept"])
def test_model_loss_only_forward_equals_logits_forward(preset):
    """Padded rows, labels: the loss-only forward returns no logits but the same losses, boundaries and
    compression, and the same gradient for every parameter (fp32, <= 1e-5)."""
    model = build_model(preset).train()
    ids, am = left_padded(B=2, T=24, pad=5)
    labels = ids.masked_fill(am == 0, -100)
    outs, grads = [], []
    for return_logits in (True, False):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        out = model(ids, attention_mask=am, labels=labels, return_logits=return_logits)
        out.loss.backward()
        outs.append(out)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    full, lean = outs
    assert full.logits is not None and lean.logits is None
    for key in ("loss", "lm_loss", "ratio_loss", "lb_loss", "z_loss"):
        assert _maxdiff(getattr(lean, key), getattr(full, key)) <= TOL, key
    if model.config.chunking:
        assert torch.equal(lean.boundary_mask, full.boundary_mask)
        assert lean.compression["ratio"] == full.compression["ratio"]
    assert grads[0].keys() == grads[1].keys()
    worst = max(_maxdiff(grads[1][n], grads[0][n]) for n in grads[0])
    assert worst <= TOL, worst


def test_loss_only_switch_reaches_a_wrapped_language_model():
    """``loss_only`` sets every ConceptMoEForCausalLM inside a module (a VLM's ``language_model``);
    forwards without labels keep their logits, and ``return_logits=False`` without labels is refused."""
    lm = build_model("tiny_concept")
    wrapper = torch.nn.Module()
    wrapper.language_model = lm
    ids = torch.randint(1, 2048, (1, 12))
    assert loss_only(wrapper) == 1
    assert lm(ids, labels=ids).logits is None and lm(ids).logits.shape == (1, 12, 2048)
    loss_only(wrapper, False)
    assert lm(ids, labels=ids).logits is not None
    with pytest.raises(ValueError, match="needs labels"):
        lm(ids, return_logits=False)


def _peak_cpu_bytes(fn) -> int:
    """Peak of live CPU allocations (profiler allocation / free records in time order) while ``fn`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cur = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        cur += e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        peak = max(peak, cur)
    return peak


def test_chunked_peak_memory_is_lower_for_a_long_row():
    """One row of 2048 tokens, vocabulary 32000 (fp32 logits 250 MiB): forward + backward. Measured
    here: full ~500 MiB (logits + their log-softmax), chunked (256 tokens) ~71 MiB."""
    torch.manual_seed(0)
    T, D, V = 2048, 64, 32000
    head = torch.nn.Linear(D, V, bias=False)
    head.weight.grad = torch.zeros_like(head.weight)  # allocated before either measurement
    h = torch.randn(1, T, D, requires_grad=True)
    labels = torch.randint(0, V, (1, T))
    full = _peak_cpu_bytes(lambda: lm_loss_fn(head(h), labels).backward())
    chunked = _peak_cpu_bytes(lambda: chunked_lm_loss(head, h, labels, chunk_tokens=256).backward())
    logits_bytes = T * V * 4
    print(f"peak CPU bytes: full {full / 2**20:.1f} MiB, chunked {chunked / 2**20:.1f} MiB")
    assert full >= logits_bytes and chunked < logits_bytes / 2 and chunked < full / 4


def test_loss_only_vlm_equals_logits_forward():
    """The VLM's forward does not pass ``return_logits`` on: ``loss_only`` (what the trainer calls)
    reaches its language model; same loss and gradients (fp32, <= 1e-5), no logits."""
    from test_vlm_model import build, sample_batch

    model = build().train()
    ids, mask, pixels = sample_batch(model.num_image_tokens)
    labels = ids.masked_fill((mask == 0) | (ids < 8), -100)
    outs, grads = [], []
    for only in (False, True):
        loss_only(model, only)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        out = model(ids, pixels, mask, labels=labels)
        out.loss.backward()
        outs.append(out)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert outs[0].logits is not None and outs[1].logits is None
    assert _maxdiff(outs[1].loss, outs[0].loss) <= TOL
    assert max(_maxdiff(grads[1][n], grads[0][n]) for n in grads[0]) <= TOL
