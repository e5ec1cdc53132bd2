"""liger-kernel's RMSNorm and fused linear cross entropy, called as our torch paths are called.

* RMSNorm: liger's Triton forward / backward in its ``gemma`` casting mode (x and w in fp32, one
  rounding of the output: ``rms_norm.rms_norm_reference``'s figures), never in place (our residual
  stream reuses the output gradient), as custom ops ``conceptmoe::liger_rms_norm{,_bwd}`` with their
  autograd registered: Dynamo sees one opaque call (a compiled block stays one graph).
* Linear cross entropy: liger's ``fused_linear_cross_entropy_forward`` (head matmul + cross entropy
  chunk by chunk, gradients computed in the forward: no [tokens, vocab] logits kept), summed over
  the labels that are not -100, the weight's gradient summed over the chunks in fp32. Our backward scales the kept gradients by the incoming one on the
  device (liger's own compares it with 1.0 on the host). Liger's forward reads the label count on
  the host (``.item()``): one named host sync per call.
Picked by ``fused_kernels``; tested against the torch paths under ``TRITON_INTERPRET=1`` on CPU
(tests/unit/modeling/test_fused_kernels.py).
"""
from __future__ import annotations

import torch

from .syncs import host_sync

try:  # (transformers' remote-code import check skips a try block: this file loads only where liger imports)
    from liger_kernel.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_forward
    from liger_kernel.ops.rms_norm import _str_to_casting_mode, rms_norm_backward, rms_norm_forward
    from liger_kernel.ops.utils import calculate_settings, element_mul_kernel
    import triton
except ImportError as e:  # pragma: no cover
    raise ImportError("vlm.modeling.liger_ops needs liger-kernel (pip install -e '.[gpu]')") from e

GEMMA = _str_to_casting_mode["gemma"]  # an int
CE_SYNC = "cross entropy (liger): its fused linear CE reads the label count on the host"


# under TRITON_INTERPRET=1 (the CPU tests) the ops get their own names: the compiled ones stay as they are
SUFFIX = "_interpreted" if triton.knobs.runtime.interpret else ""


def _define_ops():
    """Defined once per process (also when this file loads twice, as an export's remote code)."""
    if hasattr(torch.ops.conceptmoe, f"liger_rms_norm{SUFFIX}"):
        return getattr(torch.ops.conceptmoe, f"liger_rms_norm{SUFFIX}")

    @torch.library.custom_op(f"conceptmoe::liger_rms_norm{SUFFIX}", mutates_args=())
    def liger_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        y, _x, rstd, _block, _warps, _mode = rms_norm_forward(x.contiguous(), w, eps, 0.0, GEMMA, None)
        return y, rstd

    @liger_rms_norm.register_fake
    def _(x, w, eps):
        return torch.empty_like(x), x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)

    @torch.library.custom_op(f"conceptmoe::liger_rms_norm_bwd{SUFFIX}", mutates_args=())
    def liger_rms_norm_bwd(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor,
                           needs_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
        block, warps = calculate_settings(x.shape[-1])
        x2 = x.contiguous().view(-1, x.shape[-1])
        g_x, g_w = rms_norm_backward(g.contiguous(), x2, w, rstd, 0.0, GEMMA, block, warps, False, None,
                                     needs_dw=needs_dw)
        return g_x, (g_w if needs_dw else torch.zeros_like(w))

    @liger_rms_norm_bwd.register_fake
    def _(g, x, w, rstd, needs_dw):
        return torch.empty_like(g), torch.empty_like(w)

    def setup_context(ctx, inputs, output):
        x, w, _eps = inputs
        ctx.save_for_backward(x, w, output[1])

    def backward(ctx, g_y, _g_rstd):
        x, w, rstd = ctx.saved_tensors
        g_x, g_w = liger_rms_norm_bwd(g_y, x, w, rstd, ctx.needs_input_grad[1])
        return g_x, (g_w if ctx.needs_input_grad[1] else None), None

    liger_rms_norm.register_autograd(backward, setup_context=setup_context)
    return getattr(torch.ops.conceptmoe, f"liger_rms_norm{SUFFIX}")


_RMS = _define_ops()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMS(x, weight, eps)[0]


class LinearCrossEntropySum(torch.autograd.Function):
    """``sum_n [label_n != -100] CE(h_n W^T, label_n)`` (fp32 loss), liger's chunked forward."""

    @staticmethod
    def forward(ctx, h_ND, weight_VD, labels_N):
        grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        with host_sync(CE_SYNC):
            loss, _z, _acc, _pred, g_h, g_w, _g_b = fused_linear_cross_entropy_forward(
                h_ND.contiguous(), weight_VD, labels_N, ignore_index=-100, reduction="sum", accum_dtype=torch.float32,
                compute_gradients=grads, weight_requires_grad=ctx.needs_input_grad[1])
        ctx.save_for_backward(g_h if grads else None, g_w)
        return loss

    @staticmethod
    def backward(ctx, g):
        g_h, g_w = ctx.saved_tensors  # d loss / d h and d W for an incoming gradient of 1
        g = g.float().contiguous()
        return (_scale_(g_h, g) if ctx.needs_input_grad[0] else None,
                _scale_(g_w, g) if ctx.needs_input_grad[1] else None, None)


def _scale_(t_RC: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``t *= g`` in place, g an fp32 scalar on the device, the product in fp32 (one rounding to t's dtype)."""
    R, C = t_RC.shape
    element_mul_kernel[(R,)](t_RC, t_RC.stride(0), g, C, BLOCK_SIZE=min(32768, triton.next_power_of_2(C)),
                             X_col_stride=t_RC.stride(1))
    return t_RC


def linear_cross_entropy_sum(h_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    return LinearCrossEntropySum.apply(h_ND, weight_VD, labels_N)
