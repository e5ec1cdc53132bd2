"""Version-gated fix for lmms-eval 0.7.x, which turns every loglikelihood result into a string.

``unwrap_generation_output`` (applied by the evaluator to every result) makes ``(1.23, True)`` the
string ``"(1.23, True)"``, so every multiple_choice task crashes; the wrapper installed here lets
``(number, bool)`` pairs through unchanged (details: eval_suites/README.md).
"""
from __future__ import annotations

import functools
import numbers
import sys
from typing import Any

_COMPAT_MIN_VERSION = (0, 7)  # first release with unwrap_generation_output (0.6.x passes results as they are)


def _lmms_eval_version() -> tuple[int, ...] | None:
    try:
        from importlib.metadata import version

        raw = version("lmms-eval")
    except Exception:  # pragma: no cover
        return None
    parts = []
    for piece in raw.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:
            break
    return tuple(parts) or None


def is_loglikelihood_result(output: Any) -> bool:
    """A ``(number, bool)`` pair as returned by ``loglikelihood`` (never a text result)."""
    if not isinstance(output, (tuple, list)) or len(output) != 2:
        return False
    value, greedy = output
    try:
        import numpy as np

        bool_types = (bool, np.bool_)
    except ImportError:  # pragma: no cover
        bool_types = (bool,)
    return (isinstance(value, numbers.Real) and not isinstance(value, bool_types)
            and isinstance(greedy, bool_types))


def _mangles_pairs(fn) -> bool:
    try:
        text, _ = fn((-1.5, True))
    except Exception:
        return False
    return not (isinstance(text, (tuple, list)) and len(text) == 2 and float(text[0]) == -1.5)


def apply_lmms_eval_compat() -> bool:
    """Install the unwrap fix when (and only when) the installed lmms-eval needs it.

    Only lmms-eval >= 0.7 whose function really mangles a probe pair is patched, so a fixed release
    is left alone. Returns True when the fix is active afterwards. Safe to call any number of times.
    """
    version = _lmms_eval_version()
    if version is None or version < _COMPAT_MIN_VERSION:
        return False
    try:
        from lmms_eval.api import instance
    except ImportError:  # pragma: no cover
        return False
    original = getattr(instance, "unwrap_generation_output", None)
    if original is None:
        return False
    if getattr(original, "_cmoe_compat", False):
        _point_evaluator_at(original.__wrapped__, original)
        return True
    if not _mangles_pairs(original):
        return False  # a fixed lmms-eval: leave it alone

    @functools.wraps(original)
    def unwrap_generation_output(output):
        if is_loglikelihood_result(output):
            return (float(output[0]), bool(output[1])), None
        return original(output)

    unwrap_generation_output._cmoe_compat = True
    instance.unwrap_generation_output = unwrap_generation_output
    _point_evaluator_at(original, unwrap_generation_output)
    return True


def _point_evaluator_at(original, patched) -> None:
    """lmms_eval.evaluator imported the name at its import time; swap its global too."""
    evaluator = sys.modules.get("lmms_eval.evaluator")
    if evaluator is not None and getattr(evaluator, "unwrap_generation_output", None) is original:
        evaluator.unwrap_generation_output = patched
