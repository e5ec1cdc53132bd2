"""The real lmms-eval CLI with ``conceptmoe_vlm`` registered in-process.

    python -m eval_suites.lmms_cli --model conceptmoe_vlm --model_args ... --tasks ...

Same arguments and behaviour as ``python -m lmms_eval``; used by ``eval_suites.run`` only when
the ``lmms_eval.models`` entry point of this project is not installed (e.g. running from a
source tree without ``pip install -e .``). With the entry point installed, ``python -m lmms_eval``
finds the model by itself.
"""
from __future__ import annotations

import sys


def main() -> None:
    from eval_suites.lmms_plugin import register

    register()
    from lmms_eval.cli.dispatch import main as lmms_main

    lmms_main()


if __name__ == "__main__":
    main()
    sys.exit(0)
