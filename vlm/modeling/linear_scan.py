"""The first-order linear recurrence of the dechunk EMA, y_m = a_m * y_{m-1} + x_m, as one autograd
function whose op count does not depend on the length M.

Forward and backward are both the scan: the gradient of x is the reverse scan of the output gradient
with the decays shifted by one (gh_m = g_m + a_{m+1} gh_{m+1}), the gradient of a_m is
sum_D gh_m * y_{m-1}. Two implementations of the scan (``impl``; the model's ``runtime.ema_scan``):
- ``triton``: ``linear_scan_triton`` (CUDA; three kernel launches whatever M). ``auto`` takes it on CUDA
  only once the GPU check marked it correct and faster (verdict ``ema_scan_triton``, verdicts.py);
- ``torch``: the chunked closed form ``scan_torch`` (Mamba-2's SSD with one state per channel):
  chunks of Q concepts, each a [Q, Q] decay matrix times the chunk, then the chunk ends carried by one
  [N, N] decay matrix over the N chunks: about 20 ops whatever M, no Python loop. The decay matrices
  come from masked cumulative sums of log a (no difference of two large cumulative sums, no division
  by a cumulative product), so a = 0 (p = 1, a packed document's first concept) and a near 1 are exact
  to fp32 rounding. ``ema_reference`` in dechunk.py is the plain loop both are tested against.
"""
from __future__ import annotations

import importlib.util
import logging
import math

import torch
import torch.nn.functional as F

from .verdicts import proven

log = logging.getLogger(__name__)

BLOCK = 64  # concepts per chunk (the [Q, Q] decay matrix of scan_torch)
MAX_CHUNKS = 512  # beyond BLOCK * MAX_CHUNKS concepts the chunk grows, keeping the [N, N] matrix small
TINY = torch.finfo(torch.float32).tiny  # log(0) -> about -87: exp underflows to exactly 0, no -inf


def _decay_matrix(log_a_NQ: torch.Tensor) -> torch.Tensor:
    """L[..., i, j] = prod_{j < l <= i} a_l for j <= i, 0 above the diagonal, from log a [..., Q]."""
    Q = log_a_NQ.shape[-1]
    x = log_a_NQ[..., :, None].expand(*log_a_NQ.shape, Q)  # x[..., l, j] = log a_l
    return torch.exp(x.tril(-1).cumsum(-2)).tril()


def scan_torch(a_BM: torch.Tensor, x_BMD: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """y_m = a_m y_{m-1} + x_m from y_{-1} = 0, in fp32, in a number of ops independent of M."""
    B, M, D = x_BMD.shape
    Q = max(block, math.ceil(M / MAX_CHUNKS))
    pad = (-M) % Q  # identity steps (a = 1, x = 0) at the end; always padded: no branch on M for a compiler
    x = F.pad(x_BMD.float(), (0, 0, 0, pad))
    log_a_BNQ = F.pad(a_BM.float(), (0, pad), value=1.0).clamp(min=TINY).log().view(B, -1, Q)
    N = log_a_BNQ.shape[1]
    y_BNQD = _decay_matrix(log_a_BNQ) @ x.view(B, N, Q, D)  # each chunk from a zero state
    end_BND = _decay_matrix(log_a_BNQ.sum(-1)) @ y_BNQD[:, :, -1]  # the true state at each chunk's end
    start_BND = F.pad(end_BND[:, :-1], (0, 0, 1, 0))  # ... and entering each chunk
    y_BNQD = y_BNQD + torch.exp(log_a_BNQ.cumsum(-1))[..., None] * start_BND[:, :, None]
    return y_BNQD.view(B, N * Q, D)[:, :M]


def scan_torch_reverse(a_BM: torch.Tensor, x_BMD: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """y_m = a_{m+1} y_{m+1} + x_m from y_M = 0 (the backward of ``scan_torch``)."""
    a_rev = F.pad(a_BM.float().flip(1)[:, :-1], (1, 0))
    return scan_torch(a_rev, x_BMD.flip(1), block).flip(1)


def auto_impl(device_type: str, table: dict | None = None) -> str:
    """``auto``'s scan on ``device_type``: the Triton kernel on CUDA where triton imports and the GPU check
    measured it correct and faster (verdict ``ema_scan_triton``), else the torch chunked scan."""
    usable = device_type == "cuda" and importlib.util.find_spec("triton") is not None
    return "triton" if usable and proven("ema_scan_triton", table) else "torch"


_told: set[str] = set()


def _say_once(msg: str) -> None:
    if msg not in _told:
        _told.add(msg)
        log.info(msg)


def scan(a_BM: torch.Tensor, x_BMD: torch.Tensor, reverse: bool, impl: str, block: int = BLOCK) -> torch.Tensor:
    if impl == "auto":
        impl = auto_impl(x_BMD.device.type)
        if x_BMD.is_cuda and impl == "torch":
            _say_once("dechunk EMA: the torch chunked scan runs on CUDA (auto: the Triton scan is not importable or "
                      "not yet measured correct and faster by the GPU check, vlm/modeling/gpu_verdicts.json)")
    if impl == "triton":
        from .linear_scan_triton import scan as scan_triton
        return scan_triton(a_BM, x_BMD, reverse=reverse)
    if impl != "torch":
        raise ValueError(f"linear scan impl {impl!r}: use auto, torch or triton")
    return scan_torch_reverse(a_BM, x_BMD, block) if reverse else scan_torch(a_BM, x_BMD, block)


class LinearScan(torch.autograd.Function):
    """y = scan(a, x) with the reverse scan as its backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, a_BM, x_BMD, impl: str, block: int):
        y_BMD = scan(a_BM, x_BMD, False, impl, block)
        ctx.impl, ctx.block, ctx.x_dtype = impl, block, x_BMD.dtype
        ctx.save_for_backward(a_BM, y_BMD)
        return y_BMD

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_BMD):
        a_BM, y_BMD = ctx.saved_tensors
        gh_BMD = scan(a_BM, g_BMD, True, ctx.impl, ctx.block)
        grad_a = None
        if ctx.needs_input_grad[0]:
            y_prev_BMD = F.pad(y_BMD[:, :-1], (0, 0, 1, 0))
            grad_a = (gh_BMD * y_prev_BMD).sum(-1).to(a_BM.dtype)
        return grad_a, gh_BMD.to(ctx.x_dtype), None, None


def linear_scan(a_BM: torch.Tensor, x_BMD: torch.Tensor, impl: str = "auto", block: int = BLOCK) -> torch.Tensor:
    """y_m = a_m y_{m-1} + x_m (y_{-1} = 0) in fp32, differentiable in a and x. ``impl``: auto | torch |
    triton; ``block``: the torch path's chunk (the Triton kernel's is fixed)."""
    return LinearScan.apply(a_BM, x_BMD, impl, block)
