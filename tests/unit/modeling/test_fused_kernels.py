"""vlm/modeling/fused_kernels.py (issue 34 item 6): the choice of kernel per ``train.fused_kernels`` and
each fused kernel against its torch path.

Selection: ``auto`` on CPU is the torch path, said in one line; a fused kernel asked for by name where
it cannot run is one error line (CPU, package missing, ZeRO-3 or a LoRA'd head for the fused loss).
Kernels: liger's RMSNorm and fused linear cross entropy and our Triton SwiGLU run on CPU tensors
under ``TRITON_INTERPRET=1`` (triton's and liger's Python modules imported afresh under the flag, as
tests/unit/modeling/test_linear_scan.py does), forward and backward == the torch paths in fp32; a
tiny ConceptMoE's training loss and gradients with all three == the torch paths; a block compiled
fullgraph with them is one graph. Two gaps of triton 3.8's interpreter are bridged here, not in the
code: a Python float kernel argument is passed through unconverted (the compiler makes it an fp32
scalar: done here too), and ``libdevice.rsqrt`` (liger's RMSNorm) has no interpreter version
(``tl.rsqrt`` stands in). Our SwiGLU kernels also compile for sm_90 without a GPU.
"""
from __future__ import annotations

import copy
import importlib
import importlib.util
import sys

import pytest
import torch
import torch.nn as nn

import vlm.modeling
from vlm.config.train import load_train_config
from vlm.modeling import fused_kernels as fk, verdicts
from vlm.modeling.config_base import ConfigError
from vlm.modeling.expert_mlp import GroupedSwiGLU
from vlm.modeling.modeling_conceptmoe import chunked_lm_loss, loss_only

from _device import BF16_TOL, DEVICE, require_test_device, tol  # noqa: F401
from conftest import build_model
from _cuda_on_cpu import _triton_python_modules

AUTO = {"cross_entropy": "auto", "rms_norm": "auto", "swiglu": "auto"}
OURS = ["vlm.modeling.swiglu_triton", "vlm.modeling.liger_ops", "vlm.modeling.expert_mlp_fused"]


def proven_table() -> dict:
    """GPU verdicts with every fused kernel measured correct and faster."""
    table = verdicts.unmeasured()
    for kernel, name in fk.FUSED.items():
        table["paths"][f"fused_{kernel}_{name}"].update(correct=True, faster=True, measured_on="test")
    return table


# selection ------------------------------------------------------------------------------------------
def test_auto_on_cpu_is_the_torch_path_said_once():
    lines = []
    chosen = fk.configure(AUTO, "cpu", log_line=lines.append)
    assert chosen == dict.fromkeys(AUTO, "torch") and fk.ACTIVE == chosen
    assert lines == ["[train] fused kernels: torch paths for cross_entropy, rms_norm, swiglu "
                     "(auto: the fused kernels run on CUDA, the device is cpu)"]


@pytest.mark.parametrize("kernel, name", [("cross_entropy", "liger"), ("rms_norm", "liger"), ("swiglu", "triton")])
def test_a_fused_kernel_by_name_on_cpu_is_one_error_line(kernel, name):
    with pytest.raises(fk.FusedKernelError) as err:
        fk.configure({**AUTO, kernel: name}, "cpu")
    assert str(err.value) == (f"config error: train.fused_kernels.{kernel}={name}: the fused kernels run on CUDA, "
                              "the device is cpu")
    assert isinstance(err.value, ConfigError)  # vlm.train: one line, exit 2
    assert fk.ACTIVE == dict.fromkeys(AUTO, "torch")


def test_auto_on_cuda_takes_each_fused_kernel_where_it_can_run(monkeypatch):
    """(``resolve`` reads no device: the CUDA decisions are checked on this CPU.)"""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    model = build_model("tiny")
    # as shipped: no kernel measured faster on a GPU yet, so auto keeps the torch paths and says why
    assert fk.resolve(AUTO, "cuda", model) == (dict.fromkeys(AUTO, "torch"), dict.fromkeys(AUTO, fk.UNMEASURED))
    shown = proven_table()  # once the GPU check has shown them correct and faster
    assert fk.resolve(AUTO, "cuda", model, table=shown) == (fk.FUSED, {})
    chosen, why = fk.resolve(AUTO, "cuda", model, zero_stage=3, table=shown)
    assert chosen["cross_entropy"] == "torch" and "ZeRO-3" in why["cross_entropy"]
    with pytest.raises(fk.FusedKernelError, match="cross_entropy=liger: ZeRO-3 gathers"):
        fk.resolve({**AUTO, "cross_entropy": "liger"}, "cuda", model, zero_stage=3)
    model.lm_head = type("LoraLinear", (nn.Linear,), {})(8, 8, bias=False)
    chosen, why = fk.resolve(AUTO, "cuda", model, table=shown)
    assert chosen["cross_entropy"] == "torch" and "LoraLinear" in why["cross_entropy"]


def test_a_missing_package_is_named(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name))
    chosen, why = fk.resolve(AUTO, "cuda", table=proven_table())
    assert chosen == {"cross_entropy": "torch", "rms_norm": "torch", "swiglu": "triton"}
    assert why["rms_norm"] == "liger-kernel (pip install -e '.[gpu]') is not installed"
    with pytest.raises(fk.FusedKernelError, match="rms_norm=liger: liger-kernel"):
        fk.resolve({**AUTO, "rms_norm": "liger"}, "cuda")


def test_config_section_validates_each_kernel():
    cfg = load_train_config("configs/train/default.yaml", overrides=["train.fused_kernels.swiglu=torch"])
    assert cfg.train.fused_kernels.model_dump() == {**AUTO, "swiglu": "torch"}
    with pytest.raises(ConfigError, match="fused_kernels.rms_norm"):
        load_train_config("configs/train/default.yaml", overrides=["train.fused_kernels.rms_norm=triton"])
    with pytest.raises(ConfigError, match="fused_kernels"):
        load_train_config("configs/train/default.yaml", overrides=["train.fused_kernels.softmax=liger"])


def test_prepare_model_says_the_choice_or_stops_on_a_fused_name_on_cpu():
    """The trainer's ``prepare_model``: one line with ``auto``; a fused kernel by name on CPU stops it with
    the config error line (before DeepSpeed is built)."""
    from vlm.training.prepare import prepare_model

    lines = []
    cfg = load_train_config("configs/train/default.yaml", overrides=["model.kind=lm"])
    prepare_model(build_model("tiny"), cfg, zero_stage=2, world_size=1, dtype=torch.float32, log_line=lines.append,
                  device="cpu")
    assert [x for x in lines if "fused kernels" in x] == [
        "[train] fused kernels: torch paths for cross_entropy, rms_norm, swiglu "
        "(auto: the fused kernels run on CUDA, the device is cpu)"]
    assert [x for x in lines if "runtime" in x] == [  # the model's runtime choices, once
        "[train] runtime (model.runtime.*): capacity=auto (exact for host-laid-out batches), varlen_kernel=auto, "
        "attention=varlen, ema_scan=auto (torch), decode_compile_backend=inductor, concept_headroom=16"]
    cfg = load_train_config("configs/train/default.yaml", overrides=["model.kind=lm", "train.fused_kernels.swiglu=triton"])
    with pytest.raises(fk.FusedKernelError, match="^config error: train.fused_kernels.swiglu=triton: the fused"):
        prepare_model(build_model("tiny"), cfg, zero_stage=2, world_size=1, dtype=torch.float32, device="cpu")


# the kernels under the interpreter --------------------------------------------------------------------
def _interpreter_shims():
    """The two interpreter gaps of the module docstring, bridged on the freshly imported modules."""
    import numpy as np
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._implicit_cvt

    def implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return convert(arg)

    interpreter._implicit_cvt = implicit_cvt
    globals()["tl"] = tl  # the interpreter looks for triton.language in the jit function's module

    @triton.jit
    def rsqrt(x):
        return tl.rsqrt(x)

    importlib.import_module("liger_kernel.ops.rms_norm").rsqrt = rsqrt


@pytest.fixture(scope="class")
def interpreted():
    for pkg in ("triton", "liger_kernel"):
        if importlib.util.find_spec(pkg) is None:
            pytest.skip(f"{pkg} is not importable: the fused kernels cannot be checked")
    names = lambda: _triton_python_modules() + [k for k in sys.modules if k.startswith("liger_kernel")] + OURS  # noqa: E731
    saved = {k: sys.modules.pop(k) for k in names() if k in sys.modules}
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRITON_INTERPRET", "1")
            _interpreter_shims()
            yield
    finally:
        for k in names():
            sys.modules.pop(k, None)
        sys.modules.update(saved)
        for k in OURS:  # the imports set the package attributes too
            vars(vlm.modeling).pop(k.rsplit(".", 1)[1], None)
            if k in saved:
                setattr(vlm.modeling, k.rsplit(".", 1)[1], saved[k])


def _grads(fn, *tensors, seed=1):
    ts = [t.clone().requires_grad_() if t is not None else None for t in tensors]
    out = fn(*ts)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    (out * g).sum().backward()
    return [out.detach()] + [t.grad for t in ts if t is not None]


def _close(got, want, **kw):
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, **(kw or {"atol": 1e-5, "rtol": 1e-5}), msg=lambda m: f"#{i}: {m}")


@pytest.mark.usefixtures("interpreted")
class TestInterpreted:
    @pytest.mark.parametrize("shape, dtype", [((2, 5, 40), torch.float32), ((2, 3, 4, 16), torch.float32),
                                              ((2, 5, 40), torch.bfloat16)])  # hidden states, per-head q / k norms
    def test_rms_norm_equals_torch(self, shape, dtype):
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(shape, generator=g).to(dtype), torch.randn(shape[-1], generator=g).to(dtype)
        want = _grads(lambda x, w: fk.rms_norm(x, w, 1e-6), x, w)
        with fk.use(rms_norm="liger"):
            assert fk.IMPL["rms_norm"].__module__ == "vlm.modeling.liger_ops"
            got = _grads(lambda x, w: fk.rms_norm(x, w, 1e-6), x, w)
        assert [t.dtype for t in got] == [dtype] * 3
        _close(got, want, **({} if dtype == torch.float32 else BF16_TOL))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_fused_linear_cross_entropy_equals_chunked_loss(self, dtype):
        """Labels shifted, -100 ignored (a padded tail and a masked prompt), the mean over label tokens;
        gradients of the hidden states and the head's weight, also scaled by a later factor."""
        g = torch.Generator().manual_seed(0)
        h, w = torch.randn(2, 9, 16, generator=g).to(dtype), (torch.randn(50, 16, generator=g) * 0.3).to(dtype)
        labels = torch.randint(0, 50, (2, 9), generator=g)
        labels[0, :3] = -100
        labels[1, 6:] = -100

        class Head:  # what chunked_lm_loss reads of an nn.Linear: the call, out_features, weight
            out_features = 50

            def __init__(self, weight):
                self.weight = weight

            def __call__(self, x):
                return x @ self.weight.t()

        def loss(h, w):
            return (chunked_lm_loss(Head(w), h, labels, chunk_tokens=4) * 3.0).reshape(1)

        want = _grads(loss, h, w)
        with fk.use(cross_entropy="liger"):
            got = _grads(loss, h, w)
        assert [t.dtype for t in got] == [torch.float32, dtype, dtype]
        _close(got, want, **({} if dtype == torch.float32 else BF16_TOL))

    def test_fused_loss_reads_nothing_on_the_host(self):
        """No ``.item()`` / copy to the host in the fused loss, forward or backward (on CUDA each is a sync
        in every step); liger's own loop reads the label count, which the detector sees."""
        from benchmarks.op_counter import HostReadMode
        from liger_kernel.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_forward

        from vlm.modeling import liger_ops

        class Reads(HostReadMode):
            def __init__(self):
                super().__init__()
                self.seen = []

            def _read(self, op):
                self.seen.append(op)

        g = torch.Generator().manual_seed(0)
        h = torch.randn(18, 16, generator=g).requires_grad_()
        w = torch.randn(50, 16, generator=g).requires_grad_()
        labels = torch.randint(0, 50, (18,), generator=g)
        labels[:3] = -100
        assert liger_ops.chunk_rows(18, 16, 50) == 8  # three chunks, the last partial
        with Reads() as ours:
            (liger_ops.linear_cross_entropy_sum(h, w, labels) / 15).backward()
        assert ours.seen == []
        with Reads() as theirs:
            fused_linear_cross_entropy_forward(h, w, labels, reduction="sum")
        assert "_local_scalar_dense" in theirs.seen

    @pytest.mark.parametrize("weighted, dtype", [(True, torch.float32), (False, torch.float32),
                                                 (True, torch.bfloat16)])
    def test_triton_swiglu_equals_grouped_swiglu(self, weighted, dtype):
        """Three experts, rows past the last segment (zero outputs and gradients), I = 200 (two column
        tiles, the second partial), S not a multiple of the row block; bf16: the torch path rounds
        after each op, the kernel once (``BF16_TOL``)."""
        g = torch.Generator().manual_seed(0)
        S, D, I, E = 45, 8, 200, 3
        x, wgu = torch.randn(S, D, generator=g) * 0.5, torch.randn(E, D, 2 * I, generator=g) * 0.5
        wd, rw = torch.randn(E, I, D, generator=g) * 0.1, torch.rand(S, generator=g) if weighted else None
        x, wgu, wd, rw = (t.to(dtype) if t is not None else None for t in (x, wgu, wd, rw))
        offs = torch.tensor([10, 10, 38], dtype=torch.int32)  # an empty expert too
        from vlm.modeling.expert_mlp_fused import GroupedSwiGLUFused

        def run(fn):
            return _grads(lambda x, a, b, r=None: fn.apply(x, offs, a, b, r), x, wgu, wd, rw)

        want, got = run(GroupedSwiGLU), run(GroupedSwiGLUFused)
        assert all(t.dtype == dtype for t in got)
        _close(got, want, **({} if dtype == torch.float32 else BF16_TOL))
        assert got[0][38:].abs().max() == 0 and got[1][38:].abs().max() == 0
        if weighted:
            assert got[4][38:].abs().max() == 0

    def test_model_training_step_equals_torch_paths(self):
        """A tiny ConceptMoE, loss only: loss and every parameter's gradient, all three fused kernels on."""
        torch.manual_seed(0)
        model = build_model("tiny_concept").train()
        loss_only(model)
        ids = torch.randint(1, 200, (2, 24), generator=torch.Generator().manual_seed(1))
        labels = ids.clone()
        labels[1, 20:] = -100

        def step():
            model.zero_grad()
            torch.manual_seed(2)  # boundary noise
            out = model(input_ids=ids, labels=labels)
            out.loss.backward()
            return [out.loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

        want = step()
        with fk.use(cross_entropy="liger", rms_norm="liger", swiglu="triton"):
            got = step()
        assert len(got) == len(want)
        _close(got, want, atol=2e-5, rtol=1e-4)

    def test_compiled_block_with_fused_kernels_is_one_graph(self):
        """One graph (Dynamo), and compiled by ``compile_blocks`` (aot_eager: the custom ops' fake
        functions and registered backward traced) the eager block's outputs and gradients."""
        from test_compile_blocks import block_inputs, packed_batch

        from vlm.training.compile import compile_blocks

        torch._dynamo.reset()
        try:
            with fk.use(rms_norm="liger", swiglu="triton"):
                model = build_model("tiny_concept").train()
                block, (args, kwargs) = block_inputs(model, packed_batch(24, seed=0))
                ex = torch._dynamo.explain(block)(*args, **kwargs)
                assert ex.graph_break_count == 0, [r.reason.splitlines()[0] for r in ex.break_reasons]
                assert ex.graph_count == 1
                torch._dynamo.reset()
                compiled = copy.deepcopy(block)
                assert compile_blocks(compiled, backend="aot_eager") == 1
                results = []
                for b in (block, compiled):
                    x = args[0].detach().clone().requires_grad_()
                    y, stats = b(x, *args[1:], **kwargs)
                    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
                    ((y * w).sum() + stats.lb_loss).backward()
                    results.append([y, x.grad] + [p.grad for p in b.parameters()])
                _close(results[1], results[0])
        finally:
            torch._dynamo.reset()


def test_swiglu_kernels_compile_for_a_gpu_without_one():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not importable")
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vlm.modeling import swiglu_triton as k

    if k.triton.knobs.runtime.interpret:
        pytest.skip("TRITON_INTERPRET is set for this process: the kernels are interpreted, not compiled")
    for has_rw in (True, False):
        const = {"HAS_RW": has_rw, "BR": k.BR, "BI": k.BI}
        sig = dict.fromkeys(const, "constexpr") | {"S": "i32", "I": "i32"}
        for fn, ptrs in ((k._fwd, ("gu_ptr", "rw_ptr", "h_ptr")),
                         (k._bwd, ("gu_ptr", "ghw_ptr", "rw_ptr", "hw_ptr", "ggu_ptr", "grw_ptr"))):
            signature = dict.fromkeys(ptrs, "*bf16") | sig
            compiled = triton_compile(ASTSource(fn, signature, constexprs=const), target=GPUTarget("cuda", 90, 32))
            assert compiled.asm["cubin"], (fn, has_rw)


@pytest.mark.device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_on_cuda_equal_the_torch_paths(dtype):
    """The GPU check's test step (VLM_TEST_DEVICE=cuda): the compiled kernels on CUDA tensors, fp32
    (TF32 off: tight) and bf16 (``BF16_TOL``), the tiny ConceptMoE's loss and gradients."""
    if DEVICE.type != "cuda":
        pytest.skip("VLM_TEST_DEVICE is not cuda: the compiled kernels are checked under the interpreter above")
    import vlm.modeling.expert_mlp_fused  # noqa: F401  (the import walk of the GPU kit sees them)
    import vlm.modeling.liger_ops  # noqa: F401

    torch.manual_seed(0)
    model = build_model("tiny_concept").to(DEVICE, dtype).train()
    loss_only(model)
    ids = torch.randint(1, 200, (2, 64), generator=torch.Generator().manual_seed(1)).to(DEVICE)

    def step():
        model.zero_grad()
        torch.manual_seed(2)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return [out.loss.detach().float()] + [p.grad.float() for p in model.parameters() if p.grad is not None]

    want = step()
    with fk.use(cross_entropy="liger", rms_norm="liger", swiglu="triton"):
        got = step()
    _close(got, want, **(tol(2e-5, 1e-4) if dtype == torch.float32 else BF16_TOL))
