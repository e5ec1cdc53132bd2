"""vlm/modeling/cross_entropy.py: the summed cross entropy function == F.cross_entropy (the reference),
loss and logits gradient, over row chunks, ignored labels and dtypes; and what it keeps for the backward."""
from __future__ import annotations

import pytest
import torch

from vlm.modeling import cross_entropy as ce
from vlm.modeling.cross_entropy import cross_entropy_sum, cross_entropy_sum_reference


@pytest.mark.parametrize("chunk_elems", [2 ** 22, 37 * 5, 1], ids=["one-chunk", "uneven-chunks", "row-by-row"])
@pytest.mark.parametrize("ignored", ["none", "some", "all"])
def test_equals_f_cross_entropy_fp32(monkeypatch, chunk_elems, ignored):
    monkeypatch.setattr(ce, "CHUNK_ELEMS", chunk_elems)
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(23, 37, generator=g) * 4).requires_grad_()
    labels = torch.randint(0, 37, (23,), generator=g)
    if ignored == "some":
        labels[::3] = -100
    elif ignored == "all":
        labels[:] = -100
    got = cross_entropy_sum(logits, labels)
    (g_got,) = torch.autograd.grad(got * 0.7, logits)
    ref = cross_entropy_sum_reference(logits, labels)
    (g_ref,) = torch.autograd.grad(ref * 0.7, logits)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(g_got, g_ref, rtol=1e-5, atol=1e-7)
    if ignored == "all":
        assert got.item() == 0.0 and not g_got.any()


def test_bf16_logits_math_in_fp32():
    """bf16 logits: the loss is the fp32 loss of the same values; the gradient comes back in bf16."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(16, 50, generator=g) * 3).bfloat16().requires_grad_()
    labels = torch.randint(0, 50, (16,), generator=g)
    got = cross_entropy_sum(logits, labels)
    (g_got,) = torch.autograd.grad(got, logits)
    x = logits.detach().float().requires_grad_()
    ref = cross_entropy_sum_reference(x, labels)
    (g_ref,) = torch.autograd.grad(ref, x)
    assert got.dtype == torch.float32 and g_got.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(g_got.float(), g_ref, rtol=1e-2, atol=1e-3)


def test_keeps_only_the_logits_and_per_row_vectors():
    """Saved for the backward: the logits themselves (no [N, V] copy such as the log-softmax) and [N] vectors."""
    logits = torch.randn(8, 300).requires_grad_()
    labels = torch.randint(0, 300, (8,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = cross_entropy_sum(logits, labels)
    big = [t for t in saved if t.numel() >= logits.numel()]
    assert len(big) == 1 and big[0].data_ptr() == logits.data_ptr()
    assert all(t.numel() <= 8 for t in saved if t is not big[0])
    loss.backward()
    ref = logits.detach().requires_grad_()
    cross_entropy_sum_reference(ref, labels).backward()
    torch.testing.assert_close(logits.grad, ref.grad)
