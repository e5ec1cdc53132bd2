"""Count what a step asks of the host, on any device: kernel-launching ATen ops (views and allocations
excluded) by phase and component, and host reads of device data (syncs), named (inside a
``vlm.modeling.syncs.host_sync`` block) or unnamed, with the line that issued them.

On a GPU, a step whose ops and syncs outnumber another's is host-bound sooner: each launch costs a few
microseconds of host time and each sync drains the queue. Counted on CPU, the figures predict that.

    with OpCounter() as oc:
        with oc.phase("forward"):
            out = model(**inputs)
    oc.ops_by()         # Counter {(phase, component): ops}
    oc.unnamed_syncs()  # [(op, where)]
"""
from __future__ import annotations

import traceback
from collections import Counter
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vlm.modeling import syncs

# ops that read device data on the host (on CUDA each waits for the device)
READ_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "bincount", "_unique2", "unique_dim",
            "unique_consecutive", "is_nonzero", "equal", "allclose"}
INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}
# ops that launch no kernel: allocations and metadata (views are recognised by ``OpOverload.is_view``)
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
             "set_", "resize_", "_reshape_alias", "_unsafe_view", "view", "alias", "as_strided", "size", "stride",
             "is_same_size", "_has_compatible_shallow_copy_type", "record_stream", "_to_copy_meta"}

# host reads that read a CPU tensor on every device: torch's non-fused, non-capturable optimizers keep
# ``state["step"]`` on the CPU by design (torch/optim/optimizer.py ``_get_value``), so no device sync
HOST_BY_DESIGN = ("torch/optim/optimizer.py",)

# where an op comes from: the innermost frame whose file matches, first rule wins
COMPONENTS = (
    ("torch/autograd/graph.py", "autograd"),  # the engine runs a built-in function's backward
    ("torch/autograd/__init__.py", "autograd"),
    ("vlm/modeling/chunking.py", "chunking"),
    ("vlm/modeling/dechunk.py", "dechunk"),
    ("vlm/modeling/cross_entropy.py", "loss"),
    ("vlm/modeling/lm_loss.py", "loss"),
    ("vlm/modeling/varlen.py", "document layout + varlen"),
    ("vlm/modeling/", "stacks"),
    ("transformers/loss/", "loss"),
    ("transformers/masking_utils.py", "document layout + varlen"),
    ("transformers/", "stacks"),
    ("vlm/training/metrics.py", "metrics"),
    ("vlm/training/callbacks/", "metrics"),
    ("vlm/training/", "trainer"),
    ("deepspeed/", "deepspeed"),
    ("torch/optim/", "optimizer"),
    ("torch/nn/utils/clip_grad.py", "grad clip"),
)


def _component() -> tuple[str, str]:
    """(component, file:line) of the innermost frame a rule knows; ('autograd', '') inside the engine."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        for key, name in COMPONENTS:
            if key in path:
                return name, f"{path[path.rfind(key):]}:{frame.lineno}"
    return "autograd", ""


def launches_kernel(func) -> bool:
    """Not a view (``OpOverload.is_view``) nor an allocation / metadata op; a Triton kernel is not an ATen
    op and is not seen here."""
    return not func.is_view and func.overloadpacket.__name__ not in NO_KERNEL


def host_read(func, args, kwargs) -> str | None:
    """The label of a dispatched op that reads device data on the host (on CUDA it waits for the device):
    ``.item()`` / ``int`` / ``bool`` (``_local_scalar_dense``), ``nonzero``, ``unique``, boolean-mask
    indexing, ``repeat_interleave`` without ``output_size``, a copy to the CPU; None for any other op."""
    name = func.overloadpacket.__name__
    if name in READ_OPS or (name == "repeat_interleave" and func._overloadname != "self_int"
                            and kwargs.get("output_size") is None):
        return name
    if name in INDEX_OPS and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                 for i in (args[1] or ()) if i is not None):
        return f"{name}[bool mask]"
    if name in ("_to_copy", "copy_") and _to_host(func, args, kwargs):
        return f"{name}(to cpu)"
    return None


INFERENCE_MODE = ("HostReadMode: under torch.inference_mode, .item() / int(tensor) do not reach a dispatch mode "
                  "(they would count as no sync): count under torch.no_grad")


class HostReadMode(TorchDispatchMode):
    """Calls ``self._read(label)`` for every host read of tensor data: the dispatched ones (``host_read``)
    and ``.tolist()``, which reads outside the dispatcher (its own copy to the CPU is not counted again).
    Refuses to run under ``torch.inference_mode`` (``INFERENCE_MODE``: a scalar read is invisible there)."""

    def __init__(self):
        super().__init__()
        self._tolist = torch.Tensor.tolist
        self._quiet = False

    def _read(self, op: str) -> None:
        raise NotImplementedError

    def __enter__(self):
        if torch.is_inference_mode_enabled():
            raise RuntimeError(INFERENCE_MODE)
        mode, tolist = self, self._tolist

        def recording_tolist(t):
            mode._read("tolist")
            mode._quiet = True
            try:
                return tolist(t)
            finally:
                mode._quiet = False
        torch.Tensor.tolist = recording_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.is_inference_mode_enabled():  # entered outside, the counted code switched it on
            raise RuntimeError(INFERENCE_MODE)
        if not self._quiet:
            label = host_read(func, args, kwargs)
            if label is not None:
                self._read(label)
            self._op(func)
        return func(*args, **kwargs)

    def _op(self, func) -> None:
        """Every dispatched op outside ``.tolist()`` (counters override it)."""


class OpCounter(HostReadMode):
    """Records every dispatched op: (phase, component, op, where) for kernel-launching ops, and
    (op, host_sync reason or None, where) for host reads of device data."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, str, str, str]] = []
        self.reads: list[tuple[str, str | None, str]] = []
        self._phase = "other"

    @contextmanager
    def phase(self, name: str):
        prev, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = prev

    def _read(self, op: str) -> None:
        where = _component()[1]
        if not where.startswith(HOST_BY_DESIGN):
            self.reads.append((op, syncs.active(), where))

    def _op(self, func) -> None:
        name = func.overloadpacket.__name__
        if launches_kernel(func) and name != "_local_scalar_dense":
            comp, where = _component()
            self.ops.append((self._phase, comp, name, where))

    # --- summaries ---
    def total(self) -> int:
        return len(self.ops)

    def ops_by(self, key: str = "phase_component") -> Counter:
        if key == "phase":
            return Counter(p for p, _, _, _ in self.ops)
        if key == "component":
            return Counter(c for _, c, _, _ in self.ops)
        if key == "op":
            return Counter(o for _, _, o, _ in self.ops)
        return Counter((p, c) for p, c, _, _ in self.ops)

    def named_syncs(self) -> Counter:
        return Counter(why for _, why, _ in self.reads if why is not None)

    def unnamed_syncs(self) -> list[tuple[str, str]]:
        return [(op, at) for op, why, at in self.reads if why is None]


def _to_host(func, args, kwargs) -> bool:
    src = args[0] if func.overloadpacket.__name__ == "_to_copy" else args[1]
    dst = kwargs.get("device") if func.overloadpacket.__name__ == "_to_copy" else args[0].device
    return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst is not None \
        and torch.device(dst).type == "cpu"


def count_steps(step, n: int) -> dict:
    """Kernel-launching ops and host reads of ``n`` calls of ``step`` (one decoding step each), counted
    one call at a time: the mean per step, the fewest / most ops in one step (a ConceptMoE's concept
    step runs more layers than its token-only step), and the distinct sync sites."""
    ops, syncs, sites = [], [], set()
    for _ in range(n):
        with OpCounter() as oc:
            step()
        ops.append(oc.total())
        syncs.append(len(oc.reads))
        sites.update(f"{op} at {where}" + (f" ({why})" if why else "") for op, why, where in oc.reads)
    return {"steps": n, "ops_per_step": sum(ops) / n, "ops_min": min(ops), "ops_max": max(ops),
            "syncs_per_step": sum(syncs) / n, "sync_sites": sorted(sites)}
