"""vlm/modeling/rms_norm.py: the saved-less autograd RMSNorm equals the plain composition, forward and
backward, and keeps one [N, D] tensor less for the backward."""
from __future__ import annotations

import pytest
import torch

from vlm.modeling.attention import RMSNorm
from vlm.modeling.rms_norm import RMSNormFn, rms_norm_reference

from _device import dev, tol  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "head-view"])
def test_rms_norm_fn_equals_reference(dtype, transposed):
    g = torch.Generator().manual_seed(0)
    x = dev(torch.randn(2, 6, 4, 16, generator=g) * 3).to(dtype)
    if transposed:  # the per-head q / k norm takes a [B, H, T, hd] view
        x = x.transpose(1, 2)
    w = dev(torch.rand(16, generator=g) + 0.5).to(dtype)
    g_out = dev(torch.randn(x.shape, generator=g)).to(dtype)
    outs = []
    for fn in (lambda a, b: RMSNormFn.apply(a, b, 1e-5), lambda a, b: rms_norm_reference(a, b, 1e-5)):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi)
        outs.append((y, *torch.autograd.grad((y.float() * g_out.float()).sum(), [xi, wi])))
    for name, a, b in zip(["out", "input grad", "weight grad"], *outs):
        assert a.dtype == b.dtype == dtype, name
        torch.testing.assert_close(a, b, **tol(1e-5, 1e-5, dtype=dtype), msg=name)


def test_rms_norm_module_keeps_input_and_rstd_only():
    norm = dev(RMSNorm(32, 1e-6))
    x = dev(torch.randn(8, 32)).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        y = norm(x)
    assert sorted(saved) == [(8, 1), (8, 32), (32,)], saved
    y.sum().backward()
    with torch.no_grad():
        torch.testing.assert_close(norm(x), rms_norm_reference(x, norm.weight, 1e-6))
