"""liger-kernel's RMSNorm and fused linear cross entropy, called as our torch paths are called.

* RMSNorm: liger's Triton forward / backward in its ``gemma`` casting mode (x and w in fp32, one
  rounding of the output: ``rms_norm.rms_norm_reference``'s figures), never in place (our residual
  stream reuses the output gradient), as custom ops ``conceptmoe::liger_rms_norm{,_bwd}`` with their
  autograd registered: Dynamo sees one opaque call (a compiled block stays one graph).
* Linear cross entropy: liger's fused linear cross entropy in our chunk loop (``fused_linear_ce``:
  head matmul + liger's CE kernel chunk by chunk, gradients computed in the forward: no [tokens,
  vocab] logits kept), summed over the labels that are not -100, the weight's gradient summed over
  the chunks in fp32. No host read: liger's own loop reads the label count (``.item()``) and its
  backward compares the incoming gradient with 1.0 on the host; ours scales on the device.
Picked by ``fused_kernels``; tested against the torch paths under ``TRITON_INTERPRET=1`` on CPU
(tests/unit/modeling/test_fused_kernels.py).
"""
from __future__ import annotations

import torch

try:  # (transformers' remote-code import check skips a try block: this file loads only where liger imports)
    from liger_kernel.ops.cross_entropy import liger_cross_entropy_kernel
    from liger_kernel.ops.fused_linear_cross_entropy import MAX_FUSED_SIZE
    from liger_kernel.ops.rms_norm import _str_to_casting_mode, rms_norm_backward, rms_norm_forward
    from liger_kernel.ops.utils import calculate_settings, element_mul_kernel
    import triton
except ImportError as e:  # pragma: no cover
    raise ImportError("vlm.modeling.liger_ops needs liger-kernel (pip install -e '.[gpu]')") from e

GEMMA = _str_to_casting_mode["gemma"]  # an int


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


def chunk_rows(N: int, D: int, V: int) -> int:
    """Rows per chunk, liger's choice: the transient logits [chunk, V] about the size of h [N, D]."""
    if CHUNK_ROWS:
        return CHUNK_ROWS
    return min(N, triton.next_power_of_2(triton.cdiv(N, triton.cdiv(V, D))))


CHUNK_ROWS: int | None = None  # tests: several chunks at small sizes


def _accumulate(g_w_VD: torch.Tensor, g_cV: torch.Tensor, h_cD: torch.Tensor) -> None:
    """g_w += g^T h in fp32 (an fp32 accumulator straight from bf16 / fp16 GEMMs where the GPU has it)."""
    if g_cV.dtype == g_w_VD.dtype:
        g_w_VD.addmm_(g_cV.t(), h_cD)
    elif g_cV.is_cuda and torch.cuda.get_device_capability(g_cV.device)[0] >= 8:
        torch.addmm(g_w_VD, g_cV.t(), h_cD, out_dtype=torch.float32, out=g_w_VD)
    else:
        g_w_VD += torch.mm(g_cV.t(), h_cD).float()


def fused_linear_ce(h_ND, w_VD, labels_N, grads: bool, w_grad: bool):
    """(summed fp32 loss, d loss / d h or None, d loss / d W in fp32 or None), chunk by chunk: the logits
    of a chunk into one reused buffer, liger's CE kernel turning them into their gradient in place,
    then the two GEMMs of the gradients. liger's own loop (``fused_linear_cross_entropy_forward``)
    does the same but first reads the label count on the host for its mean; a sum needs none."""
    N, D = h_ND.shape
    V = w_VD.shape[0]
    chunk = chunk_rows(N, D, V)
    loss_N = torch.zeros(N, dtype=torch.float32, device=h_ND.device)  # ignored rows are not written
    g_h = torch.empty_like(h_ND) if grads else None
    g_w = torch.zeros(V, D, dtype=torch.float32, device=w_VD.device) if grads and w_grad else None
    buf = h_ND.new_empty(min(chunk, N), V)
    block = min(MAX_FUSED_SIZE, triton.next_power_of_2(V))
    for s in range(0, N, chunk):
        h_cD, labels_c = h_ND[s:s + chunk], labels_N[s:s + chunk]
        n = h_cD.shape[0]
        logits_cV = torch.mm(h_cD, w_VD.t(), out=buf[:n])
        liger_cross_entropy_kernel[(n,)](
            X_ptr=logits_cV, X_stride=logits_cV.stride(0), Y_ptr=labels_c, Y_stride=labels_c.stride(0),
            weight_ptr=None, loss_ptr=loss_N[s:s + n], z_loss_ptr=None, loss_stride=1,
            token_accuracy_ptr=None, token_accuracy_stride=0, predicted_tokens_ptr=None, predicted_tokens_stride=0,
            n_cols=V, n_non_ignore=1, sum_non_ignore_weight=1, weight_sum=0.0, ignore_index=-100,
            lse_square_scale=0.0, label_smoothing=0.0, reduction="sum", softcap=None, RETURN_Z_LOSS=False,
            RETURN_TOKEN_ACCURACY=False, RETURN_PREDICTED_TOKENS=False, HAS_WEIGHT=False, HAS_SOFTCAPPING=False,
            HAS_GRADIENTS=grads, BLOCK_SIZE=block, num_warps=32)
        if grads:  # logits_cV now holds d loss / d logits
            torch.mm(logits_cV, w_VD, out=g_h[s:s + n])
            if g_w is not None:
                _accumulate(g_w, logits_cV, h_cD)
    return loss_N.sum(), g_h, g_w


class LinearCrossEntropySum(torch.autograd.Function):
    """``sum_n [label_n != -100] CE(h_n W^T, label_n)`` (fp32 loss): ``fused_linear_ce``, no host read."""

    @staticmethod
    def forward(ctx, h_ND, weight_VD, labels_N):
        grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        loss, g_h, g_w = fused_linear_ce(h_ND.contiguous(), weight_VD, labels_N.contiguous(), grads,
                                         ctx.needs_input_grad[1])
        ctx.save_for_backward(g_h, g_w)
        ctx.w_dtype = weight_VD.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        g_h, g_w = ctx.saved_tensors  # d loss / d h and d W for an incoming gradient of 1
        g = g.float().contiguous()
        return (_scale_(g_h, g) if ctx.needs_input_grad[0] else None,
                _scale_(g_w, g).to(ctx.w_dtype) if ctx.needs_input_grad[1] else None, None)


def _scale_(t_RC: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``t *= g`` in place, g an fp32 scalar on the device, the product in fp32 (one rounding to t's dtype)."""
    R, C = t_RC.shape
    element_mul_kernel[(R,)](t_RC, t_RC.stride(0), g, C, BLOCK_SIZE=min(32768, triton.next_power_of_2(C)),
                             X_col_stride=t_RC.stride(1))
    return t_RC


def linear_cross_entropy_sum(h_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    return LinearCrossEntropySum.apply(h_ND, weight_VD, labels_N)
