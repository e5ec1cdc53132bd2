"""The real lmms-eval CLI (same arguments as ``python -m lmms_eval``) with ``conceptmoe_vlm`` registered
in-process: what ``eval_suites.run`` uses when this project's entry point is not installed."""
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
