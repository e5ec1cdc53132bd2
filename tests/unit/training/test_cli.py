"""``python -m vlm.train`` as a user meets it: the commands its ``--help`` shows run under their launchers
(checked by the launchers' own parsers), and bad input is one line, exit 2, before anything heavy."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest
from _launchers import parse_launch

from vlm.config.train import REPO_ROOT, load_train_config
from vlm.train import parse_args

PLACEHOLDERS = {"C": "configs/train/default.yaml"}  # the help's config placeholder


def help_commands(capsys) -> list[str]:
    """The command lines of ``--help`` (indented, comments dropped)."""
    with pytest.raises(SystemExit) as exc:
        parse_args(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    return [line.split("#")[0].strip() for line in text.splitlines()
            if line.startswith("    ") and line.split()[0] in ("python", "torchrun", "deepspeed")]


def test_help_commands_parse_under_their_launchers(capsys, monkeypatch):
    """Each launcher line of the help is accepted by that launcher's real parser (deepspeed's runner,
    torchrun's), launches vlm.train (the module, or the script file that exists), and vlm.train accepts
    its arguments with the config in place of C."""
    lines = help_commands(capsys)
    assert {line.split()[0] for line in lines} == {"python", "torchrun", "deepspeed"}, lines
    monkeypatch.chdir(REPO_ROOT)
    for line in lines:
        argv = [PLACEHOLDERS.get(word, word) for word in shlex.split(line)]
        launch = parse_launch(argv)
        if launch.is_module:
            assert launch.target == "vlm.train", line
        else:
            assert Path(launch.target).resolve() == (REPO_ROOT / "vlm" / "train.py").resolve(), line
        args = parse_args(launch.args)
        assert args.config == PLACEHOLDERS["C"], line
        load_train_config(args.config, args.overrides)


def test_launcher_check_refuses_what_the_launcher_refuses():
    """The check is the launcher's own: deepspeed has no -m (issue 33), torchrun has no --num_gpus."""
    from _launchers import LauncherError

    with pytest.raises(LauncherError, match="unrecognized arguments: -m"):
        parse_launch(shlex.split("deepspeed --num_gpus 8 -m vlm.train --config C"))
    with pytest.raises(LauncherError, match="num_gpus"):
        parse_launch(shlex.split("torchrun --num_gpus 2 -m vlm.train --config C"))
    launch = parse_launch(shlex.split("HF_HUB_OFFLINE=1 deepspeed --num_gpus 8 --module vlm.train --config C a=1"))
    assert (launch.launcher, launch.target, launch.is_module, launch.args) == \
        ("deepspeed", "vlm.train", True, ["--config", "C", "a=1"])
    assert sys.modules.get("deepspeed") is not None


# ---------------------------------------------------------------- bad input: one line, exit 2, nothing heavy first

def _bad_input_cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (arguments, the one line expected on stderr)."""
    from vlm.reliability.runs import TINY_LM, config, write_config

    (tmp / "empty.txt").write_text("\n \n")
    (tmp / "empty.json").write_text("[ ]\n")
    lm = write_config(tmp, config(tmp, TINY_LM, name="cli"), "lm.yaml")
    mixture = config(tmp, TINY_LM, name="cli-data", data={"kind": "mixture", "datasets": [
        {"type": "text", "path": str(tmp / "empty.txt")},
        {"type": "llava_json", "path": str(tmp / "empty.json"), "weight": 2.0},
        {"type": "text", "path": "data/default/shakespeare_train.txt", "weight": 0.0}]})
    empty = write_config(tmp, mixture, "empty.yaml")
    gone = tmp / "runs" / "does-not-exist" / "ckpt" / "step_000100"
    partial = tmp / "runs" / "killed" / "ckpt"  # a save killed midway, a folder copied by hand, a stale pointer
    (partial / "step_000004.tmp").mkdir(parents=True)
    (partial / "step_000004.tmp" / "rank_00000.json").write_text("{}")
    (partial / "step_000005").mkdir()
    (partial / "latest").write_text("step_000005\n")
    return {
        "resume path missing": (["--config", str(lm), "--resume", str(gone)],
                                f"error: --resume {gone}: folder does not exist"),
        "resume folder without a complete checkpoint": (
            ["--config", str(lm), "--resume", str(partial)],
            f"error: --resume {partial}: no complete checkpoint in that folder"),
        "every dataset empty": (["--config", str(empty)],
                                "error: config error: data: no records to draw from: every dataset with a weight "
                                f"above 0 is an empty file (data.datasets[0].path {tmp / 'empty.txt'}, "
                                f"data.datasets[1].path {tmp / 'empty.json'})"),
        "data file missing": (["--config", str(lm), "data.kind=mixture", f"data.datasets=[{{type: text, path: "
                               f"{tmp / 'nope.txt'}}}]"],
                              f"error: config error: data.datasets[0].path: file not found: {tmp / 'nope.txt'}"),
        "bad override": (["--config", str(lm), "train.lr=abc"],
                         "error: config error: train.lr: input should be a valid number, got 'abc'"),
        "bad model override": (["--config", str(lm), "model.num_experts=0"],
                               "error: config error: model.moe.num_experts: input should be greater than or equal "
                               "to 1, got 0"),
    }


@pytest.mark.parametrize("case", ["resume path missing", "resume folder without a complete checkpoint",
                                  "every dataset empty", "data file missing", "bad override", "bad model override"])
def test_bad_input_is_one_line_before_deepspeed_and_the_model(case, tmp_path, monkeypatch, capsys):
    """Exit 2 with one line, decided before DeepSpeed, the trainer or its callbacks are imported: with
    those modules made unimportable here, reaching them would be an ImportError, not the line
    (issue 33: these errors came after DeepSpeed and, for the resume and data ones, the whole model).
    Nothing is trained or written: no file appears under the run's output folder."""
    from vlm.train import main

    argv, line = _bad_input_cases(tmp_path)[case]
    monkeypatch.chdir(REPO_ROOT)
    for name in ("deepspeed", "vlm.training.trainer", "vlm.training.callbacks.defaults"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` -> ImportError
    before = sorted(tmp_path.rglob("*"))
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [line]
    assert sorted(tmp_path.rglob("*")) == before  # no run folder, no checkpoint: nothing trained


def _machine_cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (arguments, the one line expected): choices the machine or the file system refuses."""
    default = "configs/train/default.yaml"
    return {
        "liger on the CPU": ([ "--config", default, "device=cpu", "train.fused_kernels.cross_entropy=liger"],
                             "error: config error: train.fused_kernels.cross_entropy=liger: the fused kernels run on "
                             "CUDA, the device is cpu (auto or torch runs here)"),
        "triton on the CPU": (["--config", default, "device=cpu", "train.fused_kernels.swiglu=triton"],
                              "error: config error: train.fused_kernels.swiglu=triton: the fused kernels run on "
                              "CUDA, the device is cpu (auto or torch runs here)"),
        "tokenizer missing": (["--config", default, f"model.tokenizer={tmp / 'tok'}"],
                              f"error: config error: model.tokenizer: folder not found: {tmp / 'tok'} (run `make data`?)"),
        "init_from missing": (["--config", default, f"model.init_from={tmp / 'hf'}"],
                              f"error: config error: model.init_from: folder not found: {tmp / 'hf'} "
                              "(run the previous stage first?)"),
        "experts over more ranks than launched": (["--config", default, "parallel.expert_parallel_size=2"],
                                                  "error: config error: parallel.expert_parallel_size: 2: it must "
                                                  "divide the world size 1"),
    }


@pytest.mark.parametrize("case", ["liger on the CPU", "triton on the CPU", "tokenizer missing", "init_from missing",
                                  "experts over more ranks than launched"])
def test_machine_choices_are_refused_before_the_model_is_built(case, tmp_path, monkeypatch, capsys):
    """Issue 39: `train.fused_kernels.*=liger` on a CPU was refused after 25-31 s (the trainer's modules and
    the model config first), a missing model.tokenizer after 9 s. Now one line, exit 2, before the model
    builder (vlm.training.build), the trainer or DeepSpeed are imported: reaching them is an ImportError here."""
    from vlm.train import main

    argv, line = _machine_cases(tmp_path)[case]
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setenv("WORLD_SIZE", "1")  # no launcher
    for name in ("deepspeed", "vlm.training.build", "vlm.training.trainer", "vlm.training.callbacks.defaults"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` -> ImportError
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [line]


def test_device_auto_asks_for_cuda_only_when_a_fused_kernel_is_named():
    """``device: auto``: nothing named, CUDA is not asked about (no torch); a fused kernel named on a machine
    without CUDA is the one line; the kernel names and packages are fused_kernels' own."""
    from vlm.modeling import fused_kernels
    from vlm.modeling.config_base import ConfigError
    from vlm.training import machine_checks

    asked = []

    def no_cuda():
        asked.append(1)
        return False

    machine_checks.check_device_choices(load_train_config("configs/train/default.yaml"), no_cuda)
    assert asked == []
    cfg = load_train_config("configs/train/default.yaml", ["train.fused_kernels.rms_norm=liger"])
    with pytest.raises(ConfigError, match=r"^config error: train.fused_kernels.rms_norm=liger: the fused kernels run "
                                          r"on CUDA, the device is cpu"):
        machine_checks.check_device_choices(cfg, no_cuda)
    assert asked == [1]
    with pytest.raises(ConfigError, match="^config error: device: cuda was asked for but this machine has no CUDA"):
        machine_checks.check_device_choices(load_train_config("configs/train/default.yaml", ["device=cuda"]), no_cuda)
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is not None:  # a GPU and the package: accepted
        machine_checks.check_device_choices(cfg, lambda: True)
    else:
        with pytest.raises(ConfigError, match="liger-kernel .* is not installed"):
            machine_checks.check_device_choices(cfg, lambda: True)
    assert (machine_checks.FUSED, machine_checks.PACKAGE, machine_checks.DIST) == \
        (fused_kernels.FUSED, fused_kernels.PACKAGE, fused_kernels.DIST)


def test_ctrl_c_is_one_line_naming_the_checkpoint_and_resume_auto(tmp_path, monkeypatch, capsys):
    """A real SIGINT to this process at step 3 (checkpoints every 2 steps): exit 130 and one line on
    stderr, the step, the newest checkpoint and `--resume auto`, no traceback (issue 33); the
    handler is the caller's again afterwards."""
    import os
    import signal

    from vlm.reliability.runs import TINY_LM, config, write_config
    from vlm.train import INTERRUPTED, RERUN_ENV, main, resume_command
    from vlm.training.callbacks.base import Callback

    class CtrlC(Callback):
        def on_step_end(self, trainer, step):
            if step.step == 3:
                os.kill(os.getpid(), signal.SIGINT)

    cfg = write_config(tmp_path, config(tmp_path, TINY_LM, name="ctrl-c", train={"max_steps": 6},
                                        checkpoint={"every_steps": 2}))
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.delenv(RERUN_ENV, raising=False)
    before = signal.getsignal(signal.SIGINT)
    assert main(["--config", str(cfg)], extra_callbacks=[CtrlC()]) == INTERRUPTED
    ckpt = tmp_path / "ctrl-c" / "ckpt" / "step_000002"
    assert capsys.readouterr().err.splitlines() == [  # issue 39: the exact command to type, not only its flag
        f"interrupted at step 3; newest checkpoint {ckpt}; continue with: {resume_command(parse_args(['--config', str(cfg)]))}"]
    assert resume_command(parse_args(["--config", str(cfg)])).endswith(f"-m vlm.train --config {cfg} --resume auto")
    assert signal.getsignal(signal.SIGINT) is before


# ---------------------------------------------------------------- bad input before torch: a fresh interpreter

HEAVY = {"torch", "transformers", "deepspeed"}  # what a bad argument or --help must not wait for


def _light_cases(tmp: Path) -> dict[str, tuple[list[str], int, str]]:
    """name -> (arguments after ``python -m vlm.train``, exit code, the line expected: stderr's only line, or
    for --help the first line of stdout)."""
    default = "configs/train/default.yaml"
    (tmp / "empty.txt").write_text("\n")
    gone = tmp / "runs" / "does-not-exist" / "ckpt" / "step_000100"
    return {
        "help": (["--help"], 0, "usage: python -m vlm.train [-h] --config CONFIG [--resume RESUME]"),
        "bad override": (["--config", default, "train.lr=abc"], 2,
                         "error: config error: train.lr: input should be a valid number, got 'abc'"),
        "unknown key": (["--config", default, "train.lrr=1"], 2,
                        "error: config error: train.lrr: unknown config key (known here: activation_checkpointing, betas, "
                        "compile, eps, freeze, fused_kernels, grad_accum, grad_clip, lora, lr, lr_mult, max_nonfinite_in_row, "
                        "max_steps, micro_batch_size, min_lr_ratio, stage, stop_at_step, warmup_steps, weight_decay)"),
        "config file missing": (["--config", str(tmp / "nope.yaml")], 2,
                                f"error: config error: file not found: {tmp / 'nope.yaml'}"),
        "resume path missing": (["--config", default, "--resume", str(gone)], 2,
                                f"error: --resume {gone}: folder does not exist"),
        "data file missing": (["--config", default, f"data.datasets=[{{type: text, path: {tmp / 'nope.txt'}}}]"], 2,
                              f"error: config error: data.datasets[0].path: file not found: {tmp / 'nope.txt'}"),
        "every dataset empty": (["--config", default, f"data.datasets=[{{type: text, path: {tmp / 'empty.txt'}}}]"],
                                2, "error: config error: data: no records to draw from: every dataset with a weight "
                                f"above 0 is an empty file (data.datasets[0].path {tmp / 'empty.txt'})"),
        **{name: (argv, 2, line) for name, (argv, line) in _machine_cases(tmp).items()},
    }


@pytest.mark.integration  # a fresh interpreter: what `python -m vlm.train` imports is only seen there
@pytest.mark.parametrize("case", ["help", "bad override", "unknown key", "config file missing",
                                  "resume path missing", "data file missing", "every dataset empty",
                                  "liger on the CPU", "tokenizer missing"])
def test_bad_input_and_help_come_before_torch(case, tmp_path):
    """``python -m vlm.train`` with bad input or ``--help``: the one line and its exit code, and neither
    torch, transformers nor DeepSpeed imported on the way (``-X importtime`` lists every import, also
    those at exit). Issue 33: every argument error waited 14-36 s for them."""
    import os
    import subprocess

    argv, code, line = _light_cases(tmp_path)[case]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLM_TRAIN_FAULT")}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "vlm.train", *argv], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    timing = [ln for ln in proc.stderr.splitlines() if ln.startswith("import time:")]
    err = [ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:")]
    imported = {ln.rsplit("|", 1)[-1].strip().split(".")[0] for ln in timing[1:]}  # [0] is the header
    assert "vlm" in imported and "argparse" in imported, timing[:5]  # the listing is there
    assert proc.returncode == code, proc.stderr[-3000:]
    if case == "help":
        assert err == [] and proc.stdout.splitlines()[0] == line, proc.stdout
    else:
        assert err == [line]
    assert imported & HEAVY == set()


# what preflight imports before the model config (the modules; their functions' own imports are not followed)
PREFLIGHT_MODULES = ("vlm.train", "vlm.config.train", "vlm.modeling.config_base", "vlm.modeling.safe_loading",
                     "vlm.training.checkpoint_paths", "vlm.training.data", "vlm.training.machine_checks")


def module_level_imports(names, root: Path = REPO_ROOT) -> tuple[set[str], set[str]]:
    """(our modules, other top-level packages) that importing ``names`` runs: import statements outside
    functions and ``if TYPE_CHECKING:`` blocks, followed through our modules and their parent packages."""
    import ast

    from scripts.import_graph import modules

    mods = modules(root)
    ours, others, todo = set(), set(), list(names)
    while todo:
        name = todo.pop()
        if name in ours or name not in mods:
            continue
        ours.add(name)
        todo += [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]  # parent packages
        body, is_pkg = list(ast.parse(mods[name].read_text()).body), mods[name].name == "__init__.py"
        while body:
            node = body.pop()
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                body += node.orelse
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.ClassDef)):
                body += [n for field in ("body", "orelse", "finalbody", "handlers") for n in getattr(node, field, [])]
            elif isinstance(node, ast.ExceptHandler):
                body += node.body
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative, as Python resolves it
                    anchor = name.split(".")[: name.count(".") + 1 - node.level + (1 if is_pkg else 0)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in targets:
                    (todo.append(target) if target.split(".")[0] in ("vlm", "data_pipelines", "vision_encoders",
                                                                      "eval_suites") else others.add(target.split(".")[0]))
    return ours, others


def test_what_bad_input_is_checked_with_imports_nothing_heavy():
    """The unit-tier twin of the test above, read from the source: the modules ``preflight`` uses before the
    model config (and every module and package ``__init__`` they import at module level) import neither
    torch, transformers nor DeepSpeed; and the walk does see a heavy import where there is one."""
    ours, others = module_level_imports(PREFLIGHT_MODULES)
    assert {"vlm", "vlm.training", "vlm.modeling", "vlm.config.train"} <= ours  # the parents are walked
    assert {"yaml", "pydantic"} <= others
    assert others & HEAVY == set(), sorted(ours)
    assert "torch" in module_level_imports(["vlm.training.checkpoint"])[1]


def test_each_line_is_one_write(tmp_path, monkeypatch):
    """Under torchrun the ranks share one stderr pipe: a line and its newline go out in one write (print
    writes the newline apart, and two ranks' interrupt lines ran together as '... --resume autorank 0: ...'
    in tests/integration/training/test_interrupt.py). The interrupt line of a rank and an error line."""
    import io
    import types

    from vlm.train import INTERRUPTED, Interrupts, main

    writes: list[str] = []

    class Stderr(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

    monkeypatch.setattr(sys, "stderr", Stderr())
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert Interrupts().report(types.SimpleNamespace(ckpt_dir=tmp_path), None) == INTERRUPTED
    monkeypatch.chdir(REPO_ROOT)
    assert main(["--config", "configs/train/default.yaml", "train.lr=abc"]) == 2
    assert writes == [f"rank 1: interrupted before the first step; no checkpoint in {tmp_path} yet: rerun the same "
                      "command to start again\n",
                      "error: config error: train.lr: input should be a valid number, got 'abc'\n"]
