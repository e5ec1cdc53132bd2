"""Every fenced code block of README.md and docs/**/*.md runs as written.

- ``python`` blocks run for real, in order, in one scratch folder (configs/, data/, scripts/, eval_suites/
  linked in), with stdin closed (an interactive prompt fails instead of waiting).
- ``bash`` blocks run for real in that folder, after the blocks before them (the demo's export of the
  first block is what later blocks read), through tests/_readme_shim.py, which lists every rewrite it
  makes (2 training steps, 4 eval questions, ``make -n`` expansion; nothing else).
- A block preceded by ``<!-- not-run: REASON -->`` (GPUs, several nodes, data or models the user brings,
  minutes of CPU) still runs through bash with every launcher replaced by the shim's recorder: each
  torchrun / deepspeed line must pass that launcher's own parser (tests/_launchers.py), each
  ``vlm.train`` line must parse and its config and overrides validate (``vlm.train.parse_args``,
  ``load_train_config``, the model config where no pretrained folder is named), each of this repo's
  other CLIs must accept its arguments, and bash must parse the block. ``yaml`` blocks marked so are
  validated as the config fragment they show.
- ``text`` blocks are printed output; the block after ``<!-- tiny-pretrained-flow -->`` is run by
  tests/unit/training/test_pretrained_start.py.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from _readme_shim import python_target

from vlm.config.train import REPO_ROOT
from vlm.reliability.runs import clean_env

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
LANGS = ("bash", "python", "yaml", "text")
NOT_RUN = re.compile(r"^<!-- not-run: (.+) -->$")
FLOW_MARK = "<!-- tiny-pretrained-flow -->"
LINKED = ("configs", "data", "scripts", "eval_suites", "data_pipelines", "vision_encoders")  # (make reads data rules' sources)
REPO_PACKAGES = ("vlm", "eval_suites", "data_pipelines", "benchmarks", "scripts")
DEMO = "train-vlm"  # the demo's run (make train-vlm): no README example may write into it


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    not_run: str | None  # the reason, when marked
    flow: bool  # the tiny-pretrained-flow block

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO_ROOT)}:{self.line}"


def read_blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = re.match(r"^```(\S*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = lines[i - 1].strip() if i else ""
        note = NOT_RUN.match(before)
        blocks.append(Block(path, i + 1, opening.group(1), "\n".join(lines[i + 1:end]) + "\n",
                            note.group(1) if note else None, before == FLOW_MARK))
        i = end + 1
    return blocks


ALL = [block for doc in DOCS for block in read_blocks(doc)]


def command_lines(text: str) -> list[str]:
    """A bash block's commands: continuations joined, comments and blank lines dropped."""
    joined = text.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_every_block_is_accounted_for():
    """Each block says what it is: a language this test knows, and for code that is not run a reason."""
    assert len(ALL) >= 20, [b.where for b in ALL]
    for block in ALL:
        assert block.lang in LANGS, f"{block.where}: fence language {block.lang!r}; use one of {LANGS}"
        if block.lang == "yaml":
            assert block.not_run, f"{block.where}: a yaml fragment is validated only: mark it <!-- not-run: ... -->"
    flows = [b for b in ALL if b.flow]
    from test_pretrained_start import readme_flow

    assert len(flows) == 1 and command_lines(flows[0].text) == readme_flow()


def test_no_example_writes_into_the_demo_run():
    """Every vlm.train line of the docs names its own run (issue 24 item 4): none resolves to runs/train-vlm."""
    from vlm.config.train import load_train_config
    from vlm.train import parse_args

    names, cwd = {}, os.getcwd()
    os.chdir(REPO_ROOT)
    try:
        for block in (b for b in ALL if b.lang == "bash"):
            for line in command_lines(block.text):
                argv = shlex.split(line)
                found = python_target(argv)
                if found and found[1] == "vlm.train":
                    args = parse_args(argv[found[0] + 1:])
                    names[f"{block.where}: {line[:90]}"] = load_train_config(args.config, args.overrides).name
    finally:
        os.chdir(cwd)
    print(f"{len(names)} vlm.train lines, run names {sorted(set(names.values()))}")
    assert len(names) >= 10
    assert not [where for where, name in names.items() if name == DEMO], names


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a page: lower case, punctuation dropped, spaces as hyphens."""
    headings = [line.lstrip("#").strip() for line in path.read_text(encoding="utf-8").splitlines()
                if re.match(r"^#{1,6} ", line)]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_page_is_linked_and_every_link_resolves():
    """README.md links every docs/*.md page, and every relative link of README.md and docs/ names a file
    or folder of the repository (and a heading of the page, for #anchors): a moved section leaves no
    dead link."""
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    linked = {m.group(1).split("#")[0] for m in LINK.finditer(readme)}
    unlinked = [p.name for p in sorted((REPO_ROOT / "docs").glob("*.md")) if f"docs/{p.name}" not in linked]
    assert not unlinked, f"README.md does not link {unlinked}"
    dead = []
    for doc in DOCS:
        for match in LINK.finditer(doc.read_text(encoding="utf-8")):
            target = match.group(1)
            if re.match(r"^[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
                dead.append(f"{doc.relative_to(REPO_ROOT)}: {target}")
    assert not dead, dead


# ---------------------------------------------------------------- the scratch folder and the shims

def _scratch(root: Path, mode: str) -> tuple[Path, dict]:
    root.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        (root / name).symlink_to(REPO_ROOT / name)
    shims = {"python": root / ".venv" / "bin" / "python", "torchrun": root / ".venv" / "bin" / "torchrun"}
    for tool in ("deepspeed", "torchrun", "make"):
        shims[f"path-{tool}"] = root / "shim-bin" / tool
    for key, path in shims.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        tool = key.removeprefix("path-")
        path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{REPO_ROOT / "tests" / "_readme_shim.py"}" {tool} "$@"\n')
        path.chmod(0o755)
    env = clean_env(README_SHIM_MODE=mode, README_SHIM_LOG=str(root / "commands.jsonl"),
                    README_SHIM_REAL_PYTHON=sys.executable,
                    README_SHIM_REAL_TORCHRUN=str(Path(sys.executable).parent / "torchrun"),
                    README_SHIM_REAL_MAKE=shutil.which("make") or "make",
                    README_SHIM_MAKEFILE=str(REPO_ROOT / "Makefile"), TOKENIZERS_PARALLELISM="false")
    env["PATH"] = f"{root / 'shim-bin'}{os.pathsep}{env['PATH']}"
    return root, env


def _run_bash(block: Block, root: Path, env: dict, timeout: int) -> subprocess.CompletedProcess:
    script = root / f"block_{block.line}.sh"
    script.write_text("set -eo pipefail\n" + block.text)
    return subprocess.run(["bash", str(script)], cwd=root, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _records(root: Path) -> list[dict]:
    log = root / "commands.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    log.unlink(missing_ok=True)
    return records


# ---------------------------------------------------------------- validation of what is not run

class _Parsed(Exception):
    """Raised right after a CLI's argparse accepted its arguments: nothing after that runs."""


def _check_cli(target: str, args: list[str]) -> str | None:
    """Run a repo CLI up to its argument parsing (plain or intermixed); the argparse error, if any."""
    P = argparse.ArgumentParser
    originals = {name: getattr(P, name) for name in ("parse_args", "parse_intermixed_args")}

    def stopping(original):
        def parse_then_stop(self, *a, **k):
            original(self, *a, **k)
            raise _Parsed
        return parse_then_stop

    for name, original in originals.items():
        setattr(P, name, stopping(original))
    saved_argv, err = sys.argv, io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if target.endswith(".py"):
                sys.argv = [target, *args]
                runpy.run_path(target, run_name="__main__")
            else:
                sys.argv = [target, *args]
                runpy.run_module(target, run_name="__main__", alter_sys=True)
    except _Parsed:
        return None
    except SystemExit as exc:
        return f"exit {exc.code}: {err.getvalue().strip()[-300:]}"
    finally:
        for name, original in originals.items():
            setattr(P, name, original)
        sys.argv = saved_argv
    return "the CLI never parsed its arguments"


def _check_train(args: list[str]) -> str | None:
    """vlm.train's own parsing, the config with its overrides, and the model config they build."""
    from vlm.modeling.config_base import ConfigError
    from vlm.config.train import load_train_config
    from vlm.train import parse_args
    from vlm.training.build import build_model_config

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parse_args(args)
    except SystemExit as exc:
        return f"exit {exc.code}: {err.getvalue().strip()[-300:]}"
    try:
        cfg = load_train_config(ns.config, ns.overrides)
        if not (cfg.model.llm or cfg.model.init_from):  # a pretrained folder: the user's, not here
            build_model_config(cfg)
    except (ConfigError, FileNotFoundError) as exc:
        return str(exc)
    return None


LAUNCHER_PLACEHOLDERS = {"K": "0"}  # the node rank a multi-node block leaves to the reader (--node_rank K)


def _check_launcher(record: dict) -> str | None:
    """torchrun's / deepspeed's own parser accepts the line (a ``-m`` deepspeed does not know fails here)."""
    from _launchers import LauncherError, parse_launch

    try:
        parse_launch([record["tool"], *(LAUNCHER_PLACEHOLDERS.get(a, a) for a in record["argv"])])
    except LauncherError as err:
        return f"{record['tool']} refuses it: {err}"
    return None


def _check_command(record: dict) -> tuple[str | None, str]:
    """(problem or None, what was checked) for one recorded launcher call."""
    if record["tool"] == "make":
        return None, "make (its recipe lines are recorded on their own)"
    if record["tool"] in ("torchrun", "deepspeed") and (problem := _check_launcher(record)):
        return problem, ""
    argv = record["argv"]
    found = python_target(argv)
    if found is None:
        return f"no python entry point in {argv}", ""
    i, target = found
    if target == "vlm.train":
        return _check_train(argv[i + 1:]), "vlm.train config"
    if target.split(".")[0] in REPO_PACKAGES or target.startswith("scripts/"):
        return _check_cli(target, argv[i + 1:]), f"{target} arguments"
    return None, f"{target}: not ours, not checked"


def _check_yaml(block: Block) -> None:
    """A data.datasets list, or alternative vision: sections (one per line)."""
    from vlm.config.train import load_train_config
    from vlm.modeling.configuration_conceptmoe_vl import ConceptMoEVLMConfig

    top = [line for line in block.text.splitlines() if line and not line[0].isspace()]
    if top == ["datasets:"]:
        datasets = yaml.safe_load(block.text)["datasets"]
        load_train_config(None, raw={"data": {"kind": "mixture", "datasets": datasets}})
        return
    assert all(line.startswith("vision:") for line in top), f"{block.where}: a yaml fragment this test does not know"
    for line in top:
        ConceptMoEVLMConfig(vision=yaml.safe_load(line)["vision"])


def test_blocks_not_run_validate(tmp_path, monkeypatch):
    """The marked blocks: bash parses them, every launcher call is recorded (not run) and validated."""
    root, env = _scratch(tmp_path / "check", "check")
    env["GPU_CHECK_DRY_RUN"] = "1"   # scripts/gpu_check.sh prints its commands (kit install included), runs none
    monkeypatch.chdir(root)
    checked = []
    for block in (b for b in ALL if b.not_run):
        if block.lang == "yaml":
            _check_yaml(block)
            checked.append(f"{block.where}: yaml fragment")
            continue
        assert block.lang == "bash", f"{block.where}: only bash and yaml blocks may be marked not-run"
        syntax = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True, check=False)
        assert syntax.returncode == 0, f"{block.where}: {syntax.stderr}"
        proc = _run_bash(block, root, env, timeout=120)
        assert proc.returncode == 0, f"{block.where}: {proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        records = _records(root)
        if "scripts/gpu_check.sh" in block.text:   # no launcher: its own dry run lists every step
            assert "gpu_check: dry run done" in proc.stdout, f"{block.where}: {proc.stdout[-2000:]}"
            checked.append(f"{block.where}: gpu_check.sh dry run")
            continue
        assert records, f"{block.where}: no launcher call recorded"
        for record in records:
            problem, what = _check_command(record)
            assert problem is None, f"{block.where}: {' '.join(record['argv'])[:200]}\n  {problem}"
            checked.append(f"{block.where}: {what}")
    print("\n".join(checked))


def test_blocks_run_as_written(tmp_path):
    """The other python and bash blocks, in document order, in one scratch folder (rewrites: _readme_shim.py)."""
    root, env = _scratch(tmp_path / "run", "run")
    times = []
    for block in (b for b in ALL if b.lang in ("bash", "python") and not b.not_run and not b.flow):
        start = time.time()
        if block.lang == "python":
            script = root / f"block_{block.line}.py"
            script.write_text(block.text)
            proc = subprocess.run([sys.executable, script.name], cwd=root, env=env, stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=600, check=False)
        else:
            proc = _run_bash(block, root, env, timeout=600)
        assert proc.returncode == 0, f"{block.where}:\n{block.text}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        times.append(f"{block.where} ({block.lang}): {time.time() - start:.1f} s")
        _records(root)
    print("\n".join(times))
    assert len(times) >= 6, times
