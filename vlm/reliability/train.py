"""``python -m vlm.reliability.train``: ``python -m vlm.train`` (same arguments, launchers and exit codes)
with the fault plan of ``VLM_TRAIN_FAULT`` (``faults.parse``) injected through the trainer's seams
(``faults.InjectFaults``); a malformed plan is one line, exit code 2. The reliability suite and the
fault tests launch it."""
from __future__ import annotations

import os
import sys


def main(argv=None) -> int:
    from vlm.train import _quiet_imports
    from vlm.train import main as train_main

    _quiet_imports()
    from vlm.reliability.faults import ENV, Faults, FaultSpecError, InjectFaults
    try:
        faults = Faults.from_env(os.environ)
    except FaultSpecError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    spec = os.environ.pop(ENV, None)  # this process's plan is read; vlm.train refuses the variable
    try:
        return train_main(argv, extra_callbacks=[InjectFaults(faults)] if faults else [])
    finally:
        if spec is not None:
            os.environ[ENV] = spec


if __name__ == "__main__":
    from vlm.train import exit_process

    exit_process(main())
