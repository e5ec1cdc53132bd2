"""A launcher command line (``python -m M``, ``torchrun ... -m M``, ``deepspeed ... --module M`` or
``deepspeed ... script.py``) checked against the launcher's own argument parser: what it would run,
or the parser's error. Used where a command is shown but not run (``vlm.train --help``)."""
from __future__ import annotations

import contextlib
import io
import os
import re
from dataclasses import dataclass

ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass
class Launch:
    launcher: str         # python | torchrun | deepspeed
    target: str           # a module (``vlm.train``) or a script path (``vlm/train.py``)
    is_module: bool
    args: list[str]       # what the target itself receives


class LauncherError(ValueError):
    """The launcher's parser refused the line (its message), or the line names no launcher we know."""


def _parsed(parse, argv: list[str]):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse(argv)
    except SystemExit as exc:
        said = err.getvalue().strip().splitlines() or [""]
        raise LauncherError(f"exit {exc.code}: {said[-1]}") from None  # argparse's error line, not its usage


def parse_launch(argv: list[str]) -> Launch:
    """``argv`` (leading ``VAR=value`` words allowed) through the real parser of its launcher."""
    words = list(argv)
    while words and ENV_ASSIGNMENT.match(words[0]):
        words.pop(0)
    if not words:
        raise LauncherError("no command")
    tool, rest = os.path.basename(words[0]), words[1:]
    if tool in ("python", "python3"):
        if len(rest) >= 2 and rest[0] == "-m":
            return Launch("python", rest[1], True, rest[2:])
        if rest and rest[0].endswith(".py"):
            return Launch("python", rest[0], False, rest[1:])
        raise LauncherError(f"python without -m MODULE or a script: {argv}")
    if tool == "torchrun":
        from torch.distributed.run import get_args_parser

        ns = _parsed(get_args_parser().parse_args, rest)
        return Launch("torchrun", ns.training_script, bool(ns.module), list(ns.training_script_args))
    if tool == "deepspeed":
        from deepspeed.launcher.runner import parse_args

        ns = _parsed(parse_args, rest)
        return Launch("deepspeed", ns.user_script, bool(ns.module), list(ns.user_args))
    raise LauncherError(f"not a launcher this check knows: {tool}")
