"""vlm/modeling/token_reorder.py: ``gather_rows`` / ``scatter_sum`` == plain indexing (the references),
forward and backward, on both sum paths (fp32 ``index_add_``; gather + sum over K), S <= N * K."""
from __future__ import annotations

import pytest
import torch

from vlm.modeling.token_reorder import (gather_rows, gather_rows_reference, inverse_order, permute_rows, scatter_sum,
                                        scatter_sum_reference)

N, K, D = 11, 3, 8


def _order(seed: int):
    g = torch.Generator().manual_seed(seed)
    experts = torch.randint(0, 5, (N * K,), generator=g)
    order = experts.sort(stable=True).indices
    return order, order // K, inverse_order(order)


def test_inverse_order_inverts():
    order, _, inverse = _order(0)
    assert torch.equal(order[inverse], torch.arange(N * K)) and torch.equal(inverse[order], torch.arange(N * K))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["fp32", "fp64", "bf16-gather-sum"])
@pytest.mark.parametrize("S", [N * K, N * K - 7], ids=["all-rows", "fewer-rows"])
def test_match_plain_indexing_forward_and_backward(dtype, S):
    order, token, inverse = _order(1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(N, D, generator=g).to(dtype)
    y = torch.randn(S, D, generator=g).to(dtype)
    g_rows, g_tok = torch.randn(N * K, D, generator=g).to(dtype), torch.randn(N, D, generator=g).to(dtype)
    tol = dict(rtol=0, atol=0) if dtype != torch.bfloat16 else dict(rtol=2e-2, atol=2e-2)
    got, ref = [], []
    for fns, out in (((gather_rows, scatter_sum), got), ((gather_rows_reference, scatter_sum_reference), ref)):
        xl, yl = x.clone().requires_grad_(), y.clone().requires_grad_()
        rows = fns[0](xl, token, inverse)
        summed = fns[1](yl, token, inverse, N)
        (rows.float() * g_rows.float()).sum().add((summed.float() * g_tok.float()).sum()).backward()
        out.extend([rows, summed, xl.grad, yl.grad])
    for name, a, b in zip(["rows", "summed", "x grad", "y grad"], got, ref):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape, name
        torch.testing.assert_close(a.float(), b.float(), **(tol if name in ("rows", "y grad") else
                                                             dict(rtol=1e-5, atol=1e-6) if dtype != torch.bfloat16 else tol),
                                   msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_rows_is_plain_indexing_forward_and_backward(dtype):
    order, _, inverse = _order(3)
    g = torch.Generator().manual_seed(4)
    w, g_out = torch.rand(N * K, generator=g).to(dtype), torch.randn(N * K, generator=g).to(dtype)
    grads = []
    for fn in (lambda x: permute_rows(x, order, inverse), lambda x: x[order]):
        xl = w.clone().requires_grad_()
        out = fn(xl)
        (out * g_out).sum().backward()
        grads.append((out, xl.grad))
    (a, ga), (b, gb) = grads
    assert torch.equal(a, b) and torch.equal(ga, gb)  # a permutation: one term per gradient entry, exact
