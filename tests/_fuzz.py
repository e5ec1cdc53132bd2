"""Hypothesis settings for the fuzz tests (tests/unit/data_pipelines/test_fuzz_inputs.py, tests/unit/config/test_config_fuzz.py).

Two profiles, chosen with the environment variable ``VLM_FUZZ_PROFILE``:

* ``ci`` (default): ``derandomize=True`` (the same examples on every run, so CI is deterministic),
  ``deadline=None`` (a busy machine must not turn slowness into failures), no example database.
* ``faults``: 8x the examples of every test, random (not derandomized) exploration; a failure
  prints the ``@reproduce_failure`` blob to replay it. ``VLM_FUZZ_PROFILE=faults pytest tests/unit/data_pipelines/test_fuzz_inputs.py``.

Tests write ``@settings(FUZZ, max_examples=examples(n))``: ``n`` is the ci count, scaled by the
profile. ``count(name)`` tallies the examples a test really ran (hypothesis stops early when a
strategy's space is exhausted); ``report(request, counts)`` prints the tallies at module teardown.
"""
from __future__ import annotations

import os
from collections import Counter

from hypothesis import HealthCheck, settings

PROFILE = os.environ.get("VLM_FUZZ_PROFILE", "ci")
SCALE = {"ci": 1, "faults": 8}
if PROFILE not in SCALE:
    raise ValueError(f"VLM_FUZZ_PROFILE must be one of {sorted(SCALE)}, got {PROFILE!r}")

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
          HealthCheck.large_base_example]
settings.register_profile("ci", derandomize=True, deadline=None, database=None, print_blob=False,
                          suppress_health_check=_QUIET)
settings.register_profile("faults", derandomize=False, deadline=None, database=None, print_blob=True,
                          suppress_health_check=_QUIET)
FUZZ = settings.get_profile(PROFILE)  # a parent for @settings(FUZZ, ...); nothing global is loaded


def examples(n: int) -> int:
    """The number of examples for a test whose ci count is ``n``."""
    return n * SCALE[PROFILE]


def report(request, counts: Counter, what: str) -> None:
    """One terminal line: examples run per test and in total (shown without -s too)."""
    line = (f"{what} [profile {PROFILE}]: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))
            + f"; total={sum(counts.values())}")
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is None or capture is None:
        print(line)
        return
    with capture.global_and_fixture_disabled():  # teardown output is captured otherwise
        reporter.write_line("")
        reporter.write_line(line)
