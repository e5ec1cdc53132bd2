"""vlm/modeling/linear_scan.py (+ linear_scan_triton.py): the dechunk EMA as one scan whatever M.

``ema_scan`` == ``ema_reference`` forward and backward (fp32, 1e-5) over M = 1 .. 1000, batch 2,
packed documents restarted by their first concept's p = 1, p exactly 0 / 1 / tiny; long rows with p
near 0 and near 1 against a float64 loop; the Triton kernel under ``TRITON_INTERPRET=1`` on CPU
tensors (a slowly decaying state carried across its carry blocks too); and the op count of dechunk
forward + backward, the same at 1K and 16K concepts."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from benchmarks.op_counter import OpCounter
from vlm.modeling.dechunk import ema_reference, ema_scan

import _cuda_on_cpu
from _device import DEVICE, dev, require_test_device, tol  # noqa: F401

pytestmark = pytest.mark.device

MS = [1, 63, 64, 65, 1000]


def _packed_probs(B: int, M: int, seed: int = 0) -> torch.Tensor:
    """Documents of random lengths packed in each row (p = 1 at each one's first concept), p exactly 0,
    tiny and just below 1 elsewhere."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(B, M, generator=g)
    p[torch.rand(B, M, generator=g) < 0.05] = 1.0
    p[:, 0] = 1.0
    p[:, 5::11] = 0.0
    p[:, 2::13] = 1e-7
    p[:, 4::17] = 1.0 - 2 ** -20
    return p


def _check(fn, c, p, atol=1e-5):
    """fn(c, p) == ema_reference(c, p): values, d/dc and d/dp."""
    c1, p1 = c.clone().requires_grad_(), p.clone().requires_grad_()
    c2, p2 = c.clone().requires_grad_(), p.clone().requires_grad_()
    want, got = ema_reference(c1, p1), fn(c2, p2)
    torch.testing.assert_close(got, want.to(got.dtype), **tol(atol, 1e-5))
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(3)).to(want)
    (want * g).sum().backward()
    (got * g.to(got.dtype)).sum().backward()
    torch.testing.assert_close(c2.grad, c1.grad.to(c2.dtype), **tol(atol, 1e-5))
    torch.testing.assert_close(p2.grad, p1.grad.to(p2.dtype), **tol(atol, 1e-5))
    assert p1.grad.abs().sum() > 0


@pytest.mark.parametrize("M", MS)
def test_scan_equals_reference_packed_rows(M):
    B, D = 2, 8
    c = dev(torch.randn(B, M, D, generator=torch.Generator().manual_seed(1)))
    _check(ema_scan, c, dev(_packed_probs(B, M)))


def test_packed_document_restarts():
    """A document packed after another has the EMA it has alone: its first concept's p = 1 resets."""
    D = 4
    c = dev(torch.randn(1, 200, D, generator=torch.Generator().manual_seed(2)))
    p = dev(_packed_probs(1, 200, seed=4))
    p[:, 130] = 1.0
    torch.testing.assert_close(ema_scan(c, p)[:, 130:], ema_scan(c[:, 130:], p[:, 130:]), **tol(1e-6, 1e-6))


def _values_and_grads(fn, c, p, g):
    c, p = c.clone().requires_grad_(), p.clone().requires_grad_()
    y = fn(c, p)
    (y * g.to(y.dtype)).sum().backward()
    return [t.detach().double() for t in (y, c.grad, p.grad)]


@pytest.mark.parametrize("low, high", [(1e-4, 1e-3), (0.999, 1.0), (0.0, 1.0)])
def test_long_rows_p_near_0_and_1(low, high):
    """M = 3000 (47 chunks), p near 0 (the EMA remembers thousands of concepts: decays through many
    chunks, gradients summed over thousands of steps), near 1 (decays underflow) and anywhere: the
    fp32 scan is within fp32's own reach of the float64 loop, no farther than the fp32 loop (the
    gradient to p is ~300 here: 1e-5 absolute is below fp32's resolution for either), and finite."""
    B, M, D = 1, 3000, 4
    g = torch.Generator().manual_seed(5)
    c, dy = (dev(torch.randn(B, M, D, generator=g, dtype=torch.float64)) for _ in range(2))
    p = dev(low + (high - low) * torch.rand(B, M, generator=g, dtype=torch.float64))
    p[:, 0] = 1.0
    truth = _values_and_grads(ema_reference, c, p, dy)
    loop32 = _values_and_grads(ema_reference, c.float(), p.float(), dy)
    scan32 = _values_and_grads(ema_scan, c.float(), p.float(), dy)
    for name, want, fp32_loop, got in zip(("y", "dc", "dp"), truth, loop32, scan32):
        assert torch.isfinite(got).all(), name
        err, loop_err = float((got - want).abs().max()), float((fp32_loop - want).abs().max())
        assert err <= max(2 * loop_err, 1e-5 * float(want.abs().max())), (name, err, loop_err)


def test_dechunk_ops_do_not_grow_with_concepts():
    """Dechunk forward + backward: the same number of kernel-launching ops at 1K and 16K concepts, at most
    100 (the old blocked scan looped over 64-concept blocks: 195 ops at 1K, 2,115 at 16K)."""
    from benchmarks.dechunk import make_inputs, step_fn

    totals = {}
    for M in (1024, 16384):
        x = make_inputs(M, 8, 2, DEVICE, torch.float32)
        step = step_fn(x)
        with OpCounter() as ops:
            step()
        totals[M] = ops.total()
    assert totals[1024] == totals[16384] <= 100, totals


# the Triton kernel on CPU tensors under the interpreter ------------------------------------------------
@pytest.fixture(scope="class")
def interpreted_triton():
    """``vlm.modeling.linear_scan_triton`` on CPU tensors with ``TRITON_INTERPRET=1`` (tests/_cuda_on_cpu.py:
    triton's Python modules imported afresh under the flag, the process's own put back after; a skip where
    this triton's interpreter cannot run the carry kernel's loop)."""
    with _cuda_on_cpu.interpreted_triton() as module:
        yield module


class TestTritonInterpreted:
    """The fixture above lives for this class only: the compiled kernels are back for the next test."""

    @pytest.mark.parametrize("M", MS)
    def test_equals_reference(self, interpreted_triton, M):
        """Forward (3 launches) and backward (the reverse scan, 3 launches) of the Triton path == the loop."""
        B, D = 2, 5  # D below the 16-channel tile: masked channels
        c = torch.randn(B, M, D, generator=torch.Generator().manual_seed(6))
        _check(lambda c, p: ema_scan(c, p, impl="triton"), c, _packed_probs(B, M, seed=7))

    def test_many_chunks(self, interpreted_triton):
        """More chunks than one carry step holds (> 64 chunks of 64): the carry crosses its own blocks."""
        from vlm.modeling.linear_scan import scan_torch, scan_torch_reverse

        B, M, D = 1, 64 * 65 + 1, 2
        x = torch.randn(B, M, D, generator=torch.Generator().manual_seed(8))
        a = 1.0 - _packed_probs(B, M, seed=9)
        torch.testing.assert_close(interpreted_triton.scan(a, x), scan_torch(a, x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(interpreted_triton.scan(a, x, reverse=True), scan_torch_reverse(a, x),
                                   atol=1e-5, rtol=1e-5)


    @pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
    def test_slow_decay_carried_across_the_carry_blocks(self, interpreted_triton, reverse):
        """p in [1e-5, 1e-4] (a state that persists over thousands of concepts: a carry block of CB chunks
        of Q decays by about 0.8) over M spanning three carry blocks of kernel (2), D below the channel
        tile: every concept equals a float64 loop. The random p of the tests above forget within a chunk,
        so a carry dropped between chunks or between carry blocks changed nothing they compare."""
        k = interpreted_triton
        B, M, D = 2, 2 * k.CB * k.Q + 3 * k.Q + 5, 3
        g = torch.Generator().manual_seed(11)
        x = torch.randn(B, M, D, generator=g, dtype=torch.float64)
        a = 1.0 - (1e-5 + 9e-5 * torch.rand(B, M, generator=g, dtype=torch.float64))
        a[1, M // 2] = 0.0  # a packed document's restart in one row
        a, x = a.float().double(), x.float().double()  # the loop on the kernel's fp32 inputs: its error alone
        y, ys = torch.zeros(B, D, dtype=torch.float64), []
        for m in (range(M - 1, -1, -1) if reverse else range(M)):
            decay = (a[:, m + 1] if m + 1 < M else torch.zeros(B, dtype=torch.float64)) if reverse else a[:, m]
            y = decay[:, None] * y + x[:, m]
            ys.append(y)
        want = torch.stack(ys[::-1] if reverse else ys, 1)
        got = k.scan(a.float(), x.float(), reverse=reverse).double()
        crossing = [m for m in range(k.Q * k.CB - 2, M, k.Q * k.CB)]
        assert float(want[:, crossing].abs().min()) > 1.0  # the state crossing each carry block is large
        err = (got - want).abs()
        worst = int(err.amax((0, 2)).argmax())
        assert float(err.max()) <= 1e-5 * float(want.abs().max()), (float(err.max()), f"concept {worst}")


def test_triton_kernels_compile_for_a_gpu_without_one():
    """The kernels compile to a cubin for sm_90 (triton ships ptxas; no GPU needed): the interpreter runs
    Python, so it accepts what the compiler refuses (a non-constexpr global, a tl.dot shape, int64 mixes)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not importable: the Triton EMA kernel cannot be compiled")
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vlm.modeling import linear_scan_triton as k

    if k.triton.knobs.runtime.interpret:
        pytest.skip("TRITON_INTERPRET is set for this process: the kernels are interpreted, not compiled")
    def ptrs(*names):
        return dict.fromkeys(names, "*fp32")
    ints = dict.fromkeys(("L", "D", "N"), "i32")
    kernels = [(k._chunk_ends, ptrs("a_ptr", "x_ptr", "end_ptr", "dec_ptr") | ints,
                {"Q": k.Q, "BD": 64, "REVERSE": True}),
               (k._chunk_out, ptrs("a_ptr", "x_ptr", "start_ptr", "y_ptr") | ints,
                {"Q": k.Q, "BD": 64, "REVERSE": False}),
               (k._chunk_starts, ptrs("end_ptr", "dec_ptr", "start_ptr") | {"D": "i32", "N": "i32"},
                {"CB": k.CB, "BD": 64})]
    for fn, signature, constexprs in kernels:
        signature = signature | dict.fromkeys(constexprs, "constexpr")
        compiled = triton_compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], fn
        assert "mma" not in compiled.asm["ptx"]  # fp32 dots in IEEE fp32, not TF32 on tensor cores
