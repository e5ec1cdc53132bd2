"""The CPU thread policy that the ``cpu_threads`` options of training and evaluation resolve to."""
from __future__ import annotations

import os

import torch


def apply_cpu_threads(cpu_threads: int | None, processes: int = 1) -> str:
    """The CPU thread policy of every process that runs the model (training, evaluation, generation):
    ``cpu_threads`` when given, else ``OMP_NUM_THREADS`` when set (torch already follows it), else the
    cores shared by the ``processes`` of this machine. Sets torch's intra-op threads; returns one line
    saying how many and why."""
    if cpu_threads:
        torch.set_num_threads(int(cpu_threads))
        why = f"cpu_threads={cpu_threads}"
    elif "OMP_NUM_THREADS" in os.environ:
        why = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    else:
        cores = os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // max(processes, 1)))
        why = f"{cores} cores / {processes} process{'es' if processes != 1 else ''}"
    return f"cpu threads: {torch.get_num_threads()} ({why})"
