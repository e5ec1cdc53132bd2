"""The model's CUDA branches run on the CPU (issue 39, item 2): ``cuda_branches()`` makes the model take
the paths it takes on a GPU while its tensors stay on the CPU, so CI checks them without one:

* attention: CUDA's kernel choice (``runtime.varlen_kernel = "cuda"``): flash in fp16 / bf16 through
  ``features.varlen_call``, ``torch.nn.attention.varlen.varlen_attn`` replaced by ``flash_standin``: torch's signature (so
  ``features.varlen_api`` detects the same API), the real causal per-document attention (one SDPA under a
  document mask built on the device from ``cu_seq``: comparable to the CPU kernels, no host read, traceable
  by Dynamo), and the refusals of the flash kernel (dtype, shapes, strides, ``cu_seq`` int32, max lengths
  Python ints);
* the dechunk EMA: the Triton kernels (``runtime.ema_scan = "triton"``) under ``TRITON_INTERPRET=1``;
* the concept sequence at its capacity T (``runtime.capacity = "tokens"``: what "auto" picks on a GPU
  for a batch with a host layout once the GPU check proved it); the host layout itself is the caller's
  (``host_layout``).
Each choice is set on the models given (their ``config.runtime``) and put back on leaving.

``CaptureRules`` stands in for ``torch.cuda.graph`` capture (decode_graph.capture) and enforces what a real
capture needs: no host read, no held buffer replaced, no fp32 grouped GEMM (the split fallback on CUDA).
In fp32 the attention takes CUDA's other kernel (bucketed), as on a GPU.
"""
from __future__ import annotations

import importlib
import sys
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

import vlm.modeling
from benchmarks.op_counter import HostReadMode
from vlm.modeling import features, syncs, varlen
from vlm.modeling.cache import state_tensors
from vlm.modeling.varlen import DocLayout


def flash_standin(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                  window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """``varlen_attn`` of torch 2.14 on any device: [N, H, D] tokens in document order, documents
    ``cu_seq_q`` (== ``cu_seq_k``), causal for ``window_size == (-1, 0)``; refuses what FlashAttention-2
    refuses. Keys of query slot s: the slots of its document (``searchsorted``), at or before s if causal."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dtype not in (torch.float16, torch.bfloat16) or t.dtype != query.dtype:
            raise RuntimeError(f"flash varlen: {name} is {t.dtype}; FlashAttention only supports fp16 and bf16")
        if t.dim() != 3 or t.stride(-1) != 1:
            raise RuntimeError(f"flash varlen: {name} must be [total, heads, head_dim] with a contiguous last dim")
    D = query.shape[-1]
    if D % 8 or D > 256 or key.shape[-1] != D or value.shape[-1] != D:
        raise RuntimeError(f"flash varlen: head_dim {D} must be a multiple of 8, at most 256, equal for q / k / v")
    for name, cu in (("cu_seq_q", cu_seq_q), ("cu_seq_k", cu_seq_k)):
        if cu is None or cu.dtype != torch.int32 or cu.dim() != 1 or cu.device != query.device:
            raise RuntimeError(f"flash varlen: {name} must be a 1-D int32 tensor on the queries' device")
    if type(max_q) is not int or type(max_k) is not int:
        raise TypeError(f"flash varlen: max_q / max_k must be Python ints, got {type(max_q).__name__}")
    if seqused_k is not None or block_table is not None or return_aux is not None:
        raise NotImplementedError("flash_standin: training's call only (no seqused_k, block_table, return_aux)")
    Hq, Hk = query.shape[1], key.shape[1]
    if Hq != Hk and (not enable_gqa or Hq % Hk):
        raise ValueError(f"Expect query and key/value to have the same number of heads but got Hq={Hq} and Hkv={Hk}")
    if tuple(window_size) not in ((-1, -1), (-1, 0)):
        raise NotImplementedError(f"flash_standin: window_size {window_size}")
    N = query.shape[0]
    len_D = cu_seq_q.diff()
    # what flash assumes and does not check (it would read past or leave rows unwritten): on the device, no host read
    torch._assert_async((cu_seq_q[0] == 0) & (cu_seq_q[-1] == N) & (len_D >= 0).all() & (len_D <= max_q).all(),
                        "flash varlen: cu_seq must run from 0 to the token count, no document longer than max_q")
    slot_N = torch.arange(N, device=query.device, dtype=torch.int32)
    doc_N = torch.searchsorted(cu_seq_q, slot_N, right=True)
    mask_NN = doc_N[:, None] == doc_N[None, :]
    if tuple(window_size) == (-1, 0):
        mask_NN = mask_NN & (slot_N[None, :] <= slot_N[:, None])
    q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))  # [1, heads, N, D]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_NN, scale=scale, enable_gqa=Hq != Hk)
    return out[0].transpose(0, 1)


def _triton_python_modules() -> list[str]:
    return [k for k in sys.modules if (k == "triton" or k.startswith("triton.")) and not k.startswith("triton._C")]


_PROBE = """
@triton.jit
def probe(out_ptr, n):
    acc = tl.zeros([1], dtype=tl.float32)
    for _ in range(0, n, 1):
        acc += 1.0
    tl.store(out_ptr + tl.arange(0, 1), acc)
"""


def _cannot_loop_to_a_runtime_int(kernels) -> str | None:
    """Why this triton's interpreter cannot run the carry kernel's loop over a runtime int (triton 3.6 with
    numpy 2.4; see test_linear_scan.py), or None: a probe kernel with the interpreted module's triton as
    its globals (a closure over a re-imported triton is refused on a second import)."""
    scope = {"triton": kernels.triton, "tl": kernels.tl}
    out = torch.zeros(1)
    try:
        exec(_PROBE, scope)  # noqa: S102 - a fixed kernel source
        scope["probe"][(1,)](out, 3)
    except Exception as err:  # noqa: BLE001 - any failure of the probe is the reason to skip
        return f"triton {kernels.triton.__version__}'s interpreter cannot run a loop to a runtime int ({err!r:.120})"
    return None if float(out[0]) == 3.0 else f"triton {kernels.triton.__version__}'s interpreter miscounts a loop"


@contextmanager
def interpreted_triton():
    """``vlm.modeling.linear_scan_triton`` on CPU tensors with ``TRITON_INTERPRET=1``: the flag is read when
    ``triton.jit`` decorates, so triton's Python modules (not its compiled extension) and ours are imported
    afresh under it, and the process's own put back after. Yields the interpreted module."""
    pytest.importorskip("triton", reason="triton is not importable: the Triton EMA kernel cannot be checked")
    ours = "vlm.modeling.linear_scan_triton"
    saved = {k: sys.modules.pop(k) for k in _triton_python_modules() + [ours] if k in sys.modules}
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRITON_INTERPRET", "1")
            module = importlib.import_module(ours)
            why = _cannot_loop_to_a_runtime_int(module)
            if why:
                pytest.skip(why)
            yield module
    finally:
        for k in _triton_python_modules() + [ours]:
            sys.modules.pop(k, None)
        sys.modules.update(saved)
        vars(vlm.modeling).pop("linear_scan_triton", None)  # the import set the package attribute too
        if ours in saved:
            vlm.modeling.linear_scan_triton = saved[ours]


@contextmanager
def cuda_branches(*models, triton: bool = True):
    """The CUDA branches on the CPU for ``models`` (module docstring); ``triton`` False keeps the torch EMA
    scan (the interpreter runs Python per program: slow for long rows). Without a model, only the flash
    stand-in is in place (callers of ``varlen.doc_attention`` pass ``kernel="cuda"``)."""
    import torch.nn.attention.varlen as torch_varlen

    from conftest import runtime

    choices = {"varlen_kernel": "cuda", "capacity": "tokens"} | ({"ema_scan": "triton"} if triton else {})
    saved = [(runtime(m), {k: getattr(runtime(m), k) for k in choices}) for m in models]
    features.varlen_api.cache_clear()
    try:
        for opts, _ in saved:
            for k, v in choices.items():
                setattr(opts, k, v)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch_varlen, "varlen_attn", flash_standin)
            if triton:
                with interpreted_triton():
                    yield
            else:
                yield
    finally:
        for opts, old in saved:
            for k, v in old.items():
                setattr(opts, k, v)
        features.varlen_api.cache_clear()


def host_layout(batch: dict) -> DocLayout:
    """The packing collator's layout of ``batch`` (built on the host, its reads named there)."""
    return DocLayout.on_host(batch["attention_mask"].bool(), batch["segment_ids"])


class CaptureError(AssertionError):
    pass


class _CaptureMode(HostReadMode):
    """Fails on a host read (a sync: illegal while a CUDA graph captures) and on a grouped GEMM in fp32
    (on CUDA the MoE's split fallback where the grouped GEMM is missing: a host read; on the CPU the
    grouped GEMM serves fp32, so the dtype is what says the capture would break on a GPU)."""

    GROUPED = ("_grouped_mm", "grouped_mm")

    def _read(self, op: str) -> None:
        raise CaptureError(f"capture: host read {op} (host_sync: {syncs.active()})")

    def _op(self, func) -> None:
        if func.overloadpacket.__name__ in self.GROUPED and self._fp32:
            raise CaptureError(f"capture: {func.overloadpacket.__name__} in fp32 (CUDA: the split fallback)")

    def __enter__(self):
        """Also a copy to the host (``.cpu()``, ``.numpy()``, ``.to("cpu")``): on the CPU a no-op that never
        reaches the dispatcher, on CUDA a device-to-host sync."""
        self._saved = {n: getattr(torch.Tensor, n) for n in ("cpu", "numpy", "to")}

        def refuse(name):
            def call(t, *a, **k):
                raise CaptureError(f"capture: host copy .{name}()")
            return call

        def to(t, *a, _to=self._saved["to"], **k):
            if any(isinstance(x, (str, torch.device)) and torch.device(x).type == "cpu" for x in (*a, k.get("device"))):
                raise CaptureError("capture: host copy .to('cpu')")
            return _to(t, *a, **k)
        torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.to = refuse("cpu"), refuse("numpy"), to
        return super().__enter__()

    def __exit__(self, *exc):
        for n, f in self._saved.items():
            setattr(torch.Tensor, n, f)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._fp32 = any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args[:2])
        return super().__torch_dispatch__(func, types, args, kwargs)


class FakeGraph:
    """A CUDA graph's contract on the CPU: ``capture`` records without running (so the warm-up step before
    it must have done that step's work) and the addresses of every tensor the step holds; ``replay``
    runs the step again and fails if any of those tensors moved (a real graph would write the old ones)."""
    captures = 0

    def __init__(self, run):
        FakeGraph.captures += 1
        self.run, self.ptrs = run, self._ptrs(run)

    @staticmethod
    def _held(run) -> dict:
        _, state, io = run.args
        return {**state_tensors(state), **io}

    @classmethod
    def _ptrs(cls, run) -> dict:
        """(only the concept graph reads the concept caches: the others may outlive their growth)"""
        from vlm.modeling import decode_graph
        held = cls._held(run)
        if run.func is not decode_graph.concept_graph:
            held = {k: t for k, t in held.items() if not k.startswith("concept_caches")}
        return {k: t.data_ptr() for k, t in held.items()}

    def replay(self):
        assert self._ptrs(self.run) == self.ptrs, "a captured buffer moved"
        self.run()


class CaptureRules(FakeGraph):
    """``decode_graph.capture``'s stand-in: a CUDA graph's contract on the CPU. ``capture`` runs the phase
    once under the rules (a real capture records the kernels this run issues) and puts every held tensor's
    values back (a real capture runs nothing): no host read, no fp32 grouped GEMM, and every tensor of the
    state and of the phase's io at the address it had (a captured graph writes the old buffers; a buffer
    the phase replaced is one the graph never writes). ``replay`` runs the phase and fails if a buffer it
    holds moved since (concept caches: only the concept graph's, the others may outlive their growth)."""
    captures = 0

    def __init__(self, run):
        CaptureRules.captures += 1
        self.run, held = run, self._held(run)
        saved = {k: t.clone() for k, t in held.items()}
        with _CaptureMode():
            run()
        now = self._held(run)
        moved = sorted(k for k, t in held.items() if k not in now or now[k].data_ptr() != t.data_ptr())
        if moved:
            raise CaptureError(f"capture: held buffers replaced during capture: {moved}")
        for k, t in held.items():
            t.copy_(saved[k])
        self.ptrs = self._ptrs(run)
