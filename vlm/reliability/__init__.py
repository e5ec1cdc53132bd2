"""The reliability suite: fault injection into real training runs, and a soak run.

    python -m vlm.reliability                 # `make faults`: every case, 5 kill -9 trials, 2,000-step soak
    python -m vlm.reliability --quick         # the subset `make test` runs (tests/test_faults.py)

- ``harness.py``: launching 2-process ZeRO-2 CPU runs in the background, watching their progress,
  killing a chosen rank, comparing final parameters.
- ``cases.py``: the fault cases (kill -9 at random steps, kill -9 inside a checkpoint write,
  ENOSPC in the writers, a rank dying or stalling) and what each must show.
- ``soak.py``: a long run with frequent checkpoints: memory, file descriptors, checkpoint count.
- ``runs.py``: tiny training configs and a clean subprocess environment (also used by the tests).
- ``__main__.py``: runs them and prints / writes the table (runs/faults/faults.md).

The hooks the cases pull live in ``vlm/training/fault_injection.py``.
"""
