"""Stand-in for the launchers a README code block calls (tests/integration/docs/test_readme_blocks.py puts it in front of
``.venv/bin/python``, ``.venv/bin/torchrun``, ``torchrun``, ``deepspeed`` and ``make`` in a scratch folder).

Every command line is appended to ``$README_SHIM_LOG`` (JSON lines). With ``README_SHIM_MODE=check`` nothing
runs (the test validates the recorded lines); with ``run`` the command runs for real at reduced size,
and these are ALL the rewrites (``reduced``):

- ``vlm.train``: ``TRAIN_REDUCED`` inserted right after ``--config C`` (2 steps, 4 eval questions, no
  progress bar), so any override the line itself gives still wins;
- ``eval_suites.run`` / ``lmms_eval``: ``--limit 4``; ``eval_suites.text_eval``: ``--max-tokens 512``;
- ``make T``: the recipe lines of ``make -n T`` with the setup / data stamps taken as made (``-o``: the
  suite runs on the environment and data ``make test`` built), each run through these same shims;
  ``make test`` (the suite itself) is not run from inside the suite.
``deepspeed`` never runs here (GPU launcher): a runnable block that calls it fails.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

TRAIN_REDUCED = ["train.max_steps=2", "log.every_steps=1", "log.progress_bar=false", "eval.limit=4",
                 "eval.every_steps=0"]
APPEND = {"eval_suites.run": ["--limit", "4"], "lmms_eval": ["--limit", "4"],
          "eval_suites.text_eval": ["--max-tokens", "512"]}
MAKE_MADE = [".venv/.installed", "data/default/.built", "data/default/eval/manifest.json"]  # Makefile stamps


def python_target(argv: list[str]) -> tuple[int, str] | None:
    """(index, module) of ``-m MOD`` / ``--module MOD``, or of the first ``*.py`` script."""
    for i, arg in enumerate(argv[:-1]):
        if arg in ("-m", "--module"):
            return i + 1, argv[i + 1]
    for i, arg in enumerate(argv):
        if arg.endswith(".py"):
            return i, arg
    return None


def reduced(argv: list[str]) -> list[str]:
    found = python_target(argv)
    if found is None:
        return argv
    i, module = found
    if module == "vlm.train":
        at = argv.index("--config", i) + 2
        return argv[:at] + TRAIN_REDUCED + argv[at:]
    extra = APPEND.get(module, [])
    if "--" in argv[i:]:
        at = argv.index("--", i)
        return argv[:at] + extra + argv[at:]
    return argv + extra


def run_make(argv: list[str], mode: str) -> int:
    if mode == "run" and argv[:1] == ["test"]:
        print("[readme-shim] make test: the suite itself, not run from inside it", flush=True)
        return 0
    made = [arg for stamp in MAKE_MADE for arg in ("-o", stamp)]
    proc = subprocess.run([os.environ["README_SHIM_REAL_MAKE"], "-s", "-n", "-f", os.environ["README_SHIM_MAKEFILE"],
                           *made, *argv], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        return proc.returncode
    for line in proc.stdout.splitlines():
        if not line.strip() or line.startswith("make"):
            continue
        print(f"[readme-shim] make {' '.join(argv)}: {line}", flush=True)
        code = subprocess.run(["bash", "-ec", line], check=False).returncode
        if code != 0:
            return code
    return 0


def main() -> int:
    tool, argv = sys.argv[1], sys.argv[2:]
    mode = os.environ["README_SHIM_MODE"]
    with open(os.environ["README_SHIM_LOG"], "a", encoding="utf-8") as f:
        f.write(json.dumps({"tool": tool, "argv": argv}) + "\n")
    if tool == "make":
        return run_make(argv, mode)
    if mode == "check":
        return 0
    if tool == "deepspeed":
        print("[readme-shim] deepspeed (GPU launcher) in a block that runs: mark it <!-- not-run: ... -->",
              file=sys.stderr)
        return 2
    real = os.environ["README_SHIM_REAL_PYTHON"] if tool == "python" else os.environ["README_SHIM_REAL_TORCHRUN"]
    argv = reduced(argv)
    print(f"[readme-shim] {tool} {' '.join(argv)}", flush=True)
    os.execv(real, [real, *argv])


if __name__ == "__main__":
    sys.exit(main())
