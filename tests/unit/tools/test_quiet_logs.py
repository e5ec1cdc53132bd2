"""Noise a new user met on every run: DeepSpeed's "Setting accelerator to CPU" notice from every process
(dropped by a filter on DeepSpeed's logger that ``import vlm`` installs; every other DeepSpeed record passes)."""
from __future__ import annotations

import logging

import vlm  # noqa: F401  (installs the filter)


def _record(msg: str, name: str = "DeepSpeed") -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, "real_accelerator.py", 213, msg, None, None)


def test_deepspeed_cpu_notice_is_dropped_and_nothing_else():
    from deepspeed.utils.logging import logger

    assert logger is logging.getLogger("DeepSpeed")
    notice = ("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
    assert not logger.filter(_record(notice))
    assert logger.filter(_record("Setting ds_accelerator to cpu (auto detect)"))
    assert logger.filter(_record("[Rank 0] ZeRO stage 2: a real warning"))
    for ours in ("vision_encoders", "vlm", "root"):  # our own loggers carry no such filter
        assert logging.getLogger(ours).filter(_record(notice, ours))
