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
    return {
        "resume path missing": (["--config", str(lm), "--resume", str(gone)],
                                f"error: --resume {gone}: folder does not exist"),
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


@pytest.mark.parametrize("case", ["resume path missing", "every dataset empty", "data file missing", "bad override",
                                  "bad model override"])
def test_bad_input_is_one_line_before_deepspeed_and_the_model(case, tmp_path, monkeypatch, capsys):
    """Exit 2 with one line, decided before DeepSpeed, the trainer or its callbacks are imported: with
    those modules made unimportable here, reaching them would be an ImportError, not the line
    (issue 33: these errors came after DeepSpeed and, for the resume and data ones, the whole model)."""
    from vlm.train import main

    argv, line = _bad_input_cases(tmp_path)[case]
    monkeypatch.chdir(REPO_ROOT)
    for name in ("deepspeed", "vlm.training.trainer", "vlm.training.callbacks.defaults"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` -> ImportError
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [line]


def test_ctrl_c_is_one_line_naming_the_checkpoint_and_resume_auto(tmp_path, monkeypatch, capsys):
    """A real SIGINT to this process at step 3 (checkpoints every 2 steps): exit 130 and one line on
    stderr, the step, the newest checkpoint and `--resume auto`, no traceback (issue 33); the
    handler is the caller's again afterwards."""
    import os
    import signal

    from vlm.reliability.runs import TINY_LM, config, write_config
    from vlm.train import INTERRUPTED, main
    from vlm.training.callbacks.base import Callback

    class CtrlC(Callback):
        def on_step_end(self, trainer, step):
            if step.step == 3:
                os.kill(os.getpid(), signal.SIGINT)

    cfg = write_config(tmp_path, config(tmp_path, TINY_LM, name="ctrl-c", train={"max_steps": 6},
                                        checkpoint={"every_steps": 2}))
    monkeypatch.chdir(REPO_ROOT)
    before = signal.getsignal(signal.SIGINT)
    assert main(["--config", str(cfg)], extra_callbacks=[CtrlC()]) == INTERRUPTED
    ckpt = tmp_path / "ctrl-c" / "ckpt" / "step_000002"
    assert capsys.readouterr().err.splitlines() == [
        f"interrupted at step 3; newest checkpoint {ckpt}: rerun with --resume auto"]
    assert signal.getsignal(signal.SIGINT) is before
