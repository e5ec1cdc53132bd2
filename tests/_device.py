"""The device the model-level tests run on: ``VLM_TEST_DEVICE=cpu`` (default) | ``cuda`` | ``cuda:N``.

Tests marked ``@pytest.mark.device`` build their models and inputs on ``DEVICE`` (everything else
stays on the CPU), so the CUDA subset is::

    VLM_TEST_DEVICE=cuda python -m pytest -m device

Import it the way the tests import ``conftest`` (``tests/`` is on ``sys.path`` under pytest's
default import mode; ``tests`` itself is NOT importable as a package here: latex2sympy2, an
lmms-eval dependency, installs a top-level ``tests`` package that shadows ours)::

    from _device import DEVICE, ON_CUDA, dev, tol, dtype_for, require_test_device  # noqa: F401

(``require_test_device`` is an autouse fixture: importing it into a test module is what makes a
bad ``VLM_TEST_DEVICE`` stop the run.)

Precision policy:
* CPU: fp32 and the tests' own tolerances, unchanged (``tol(a, r)`` returns ``a, r``).
* CUDA, exactness tests (dispatch == loop, cached == full forward, causality, packing): still fp32,
  with TF32 switched off and deterministic algorithms on, so a CUDA run checks the same identities;
  ``tol`` only puts a small floor (``CUDA_FP32_FLOOR``) under the tolerances, because two fp32
  computations of one value can take different cuBLAS kernels (e.g. a different expert segment
  length) and differ in the last bits.
* CUDA, tests about bf16-safe behaviour (finite losses and gradients, grouped-GEMM dispatch): bf16
  (``dtype_for(exact=False)``) with ``tol(..., dtype=torch.bfloat16)`` = ``BF16_TOL``.

Asking for CUDA where there is none stops the run with one line (exit code 4) - the tests never
fall back to the CPU silently.
"""
from __future__ import annotations

import os

import pytest
import torch

ENV = "VLM_TEST_DEVICE"
CUDA_FP32_FLOOR = 2e-5
BF16_TOL = {"atol": 5e-2, "rtol": 5e-2}  # bf16 has 8 mantissa bits: ~4e-3 relative per rounding


class _BadDevice(Exception):
    pass


def _resolve(raw: str) -> torch.device:
    raw = raw.strip().lower() or "cpu"
    try:
        dev = torch.device(raw)
    except RuntimeError:
        raise _BadDevice(f"{ENV}={raw!r} is not a device (use cpu, cuda or cuda:N)") from None
    if dev.type not in ("cpu", "cuda"):
        raise _BadDevice(f"{ENV}={raw!r}: only cpu and cuda[:N] are supported")
    if dev.type == "cpu":
        return dev
    if not torch.cuda.is_available():
        raise _BadDevice(f"{ENV}={raw} but torch.cuda.is_available() is False (torch {torch.__version__}, "
                         f"CUDA {torch.version.cuda}); refusing to run the tests on the CPU instead")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise _BadDevice(f"{ENV}={raw} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return torch.device("cuda", index)


try:
    DEVICE: torch.device = _resolve(os.environ.get(ENV, "cpu"))
    DEVICE_ERROR: str | None = None
except _BadDevice as err:
    # Importing never raises (a collection error per test module would bury the message); the
    # autouse fixture below stops the whole run with this one line at the first test instead. The
    # device stays the requested one, so nothing can quietly run on the CPU in the meantime.
    DEVICE_ERROR = f"tests/_device.py: {err}"
    DEVICE = torch.device("cuda") if os.environ.get(ENV, "").strip().lower().startswith("cuda") \
        else torch.device("meta")
ON_CUDA: bool = DEVICE.type == "cuda"


@pytest.fixture(autouse=True, scope="session")
def require_test_device():
    """Autouse in every module that imports it by name: a bad ``VLM_TEST_DEVICE`` ends the run at
    the first test with one line and exit code 4."""
    if DEVICE_ERROR is not None:
        pytest.exit(DEVICE_ERROR, returncode=pytest.ExitCode.USAGE_ERROR)
    yield


if ON_CUDA and DEVICE_ERROR is None:
    # exactness tests stay exact-ish in fp32: no TF32 anywhere (matmul, cuDNN convolutions = the
    # ViT patch embedding) and deterministic kernels (index_add_ without atomics ...); ops without
    # a deterministic CUDA kernel only warn
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.cuda.set_device(DEVICE)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(True, warn_only=True)


def dev(*xs):
    """Move tensors / modules (or a tuple / list / dict of them) to ``DEVICE``; one argument in,
    one out. On the CPU this returns the very same objects."""
    def move(x):
        if isinstance(x, (torch.Tensor, torch.nn.Module)):
            return x.to(DEVICE)
        if isinstance(x, (tuple, list)):
            return type(x)(move(v) for v in x)
        if isinstance(x, dict):
            return {k: move(v) for k, v in x.items()}
        return x
    out = tuple(move(x) for x in xs)
    return out[0] if len(out) == 1 else out


def dtype_for(exact: bool = True) -> torch.dtype:
    """fp32 for exactness tests (always); bf16 on CUDA for tests about bf16-safe behaviour."""
    return torch.bfloat16 if (ON_CUDA and not exact) else torch.float32


def tol(atol: float, rtol: float | None = None, dtype: torch.dtype = torch.float32) -> dict:
    """``assert_close`` keyword arguments: the test's own on the CPU, floored on CUDA (fp32), the
    bf16 tolerance for bf16 tensors."""
    rtol = atol if rtol is None else rtol
    if dtype in (torch.bfloat16, torch.float16):
        return dict(BF16_TOL)
    if ON_CUDA:
        return {"atol": max(atol, CUDA_FP32_FLOOR), "rtol": max(rtol, CUDA_FP32_FLOOR)}
    return {"atol": atol, "rtol": rtol}


def generator(seed: int) -> torch.Generator:
    """A seeded generator on ``DEVICE`` (sampling on CUDA needs a CUDA generator)."""
    return torch.Generator(device=DEVICE).manual_seed(seed)


cuda_only = pytest.mark.skipif(not ON_CUDA, reason=f"CUDA only ({ENV}=cuda)")
