"""``python -m vlm.train``: train a ConceptMoE-VL model (or the text-only ConceptMoE LM) with
DeepSpeed under any launcher; ``--help`` lists the launch modes, overrides and exit codes."""
from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # `deepspeed vlm/train.py`: make the repo importable
    _here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0]) == _here:
        sys.path.pop(0)  # vlm/ itself must not shadow top-level modules
    sys.path.insert(0, os.path.dirname(_here))

import argparse

FAULT_ENV = "VLM_TRAIN_FAULT"  # read by vlm/reliability/train.py only
RERUN_ENV = "VLM_RERUN"  # set by `make train-vlm`: the make command that reran this run (+ RESUME=auto resumes)

USAGE = """\
The same command runs under every launcher (DeepSpeed is the engine in every mode):

    python -m vlm.train --config C                                   # 1 process (CPU: gloo, fp32)
    torchrun --nproc_per_node 2 -m vlm.train --config C              # 2 processes, one machine
    deepspeed --num_gpus 8 --module vlm.train --config C             # GPUs (bf16, nccl)
    deepspeed --hostfile hosts --num_nodes 2 --num_gpus 8 vlm/train.py --config C   # multi-node

Overrides: train.lr=1e-3 data.max_length=256 model.num_experts=16 deepspeed=zero3 (see
vlm/config/train.py). --resume auto continues from the newest complete checkpoint of the
run (runs/<name>/ckpt) or starts fresh if there is none; --resume PATH takes a checkpoint folder
(.../step_000123) or a checkpoint dir.

Exit codes: 0 done, 2 config or data error (too many bad records: data.max_bad_fraction), 3 aborted
on non-finite steps, 4 a collective failed (another rank died or stalled longer than dist_timeout_s),
5 a checkpoint could not be written (e.g. disk full; the previous one is intact), 130 interrupted
(Ctrl-C): one line per rank names the newest checkpoint and the command that resumes from it
(`make train-vlm RESUME=auto` under make; this command with --resume auto).
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vlm.train", description="Train a ConceptMoE-VL model (or the "
                                "text-only ConceptMoE LM) with DeepSpeed.", epilog=USAGE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="training YAML (configs/train/*.yaml)")
    p.add_argument("--resume", default=None, help="'auto' or a checkpoint folder / checkpoint dir")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None,
                   help="set by the deepspeed launcher; LOCAL_RANK from the environment is used")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation at the end")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    return p.parse_intermixed_args(argv)  # overrides may stand after a flag (--resume X a.b=1)


def _quiet_imports() -> None:
    # timm imports wandb (if installed) at import time only to offer it as a logger: ~10 s on a
    # small machine for a package we never use. Hide it unless asked for.
    if os.environ.get("VLM_ALLOW_WANDB") != "1" and "wandb" not in sys.modules:
        sys.modules["wandb"] = None  # `import wandb` -> ImportError; find_spec -> None
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    # torch 2.14 deprecates the collective names DeepSpeed calls on every step; say it once, not 1000x
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed", category=FutureWarning)


def preflight(args: argparse.Namespace):
    """What is checked before the Trainer (DeepSpeed, the model, the process group), cheapest first:
    the config and its overrides, the model's folders and what needs CUDA (device: cuda, a fused kernel
    named), the data files (present, not all empty) and the ``--resume`` path
    without torch or transformers loaded; then the model config of a preset (with its tokenizer; a
    pretrained folder's is read by the trainer), which needs transformers. Returns the config;
    raises ``ConfigError`` / ``FileNotFoundError`` (one line each)."""
    from vlm.config.train import load_train_config
    from vlm.modeling.config_base import ConfigError
    from vlm.training.checkpoint_paths import resolve_resume
    from vlm.training.data import check_data_paths
    from vlm.training.machine_checks import check_machine

    cfg = load_train_config(args.config, args.overrides)
    if args.no_eval:
        cfg.eval.vqa_json = None
    if os.environ.get(FAULT_ENV):
        raise ConfigError(f"config error: {FAULT_ENV} is set: faults are injected by python -m "
                          "vlm.reliability.train (vlm/reliability/faults.py), never by python -m vlm.train")
    check_machine(cfg)
    check_data_paths(cfg)
    resolve_resume(args.resume, cfg.ckpt_dir)
    if cfg.model.preset is not None and not cfg.model.llm:
        from vlm.training.build import build_model_config, load_tokenizer

        build_model_config(cfg, load_tokenizer(cfg.model.tokenizer))
    return cfg


INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


def resume_command(args: argparse.Namespace) -> str:
    """The command that continues this run: `make train-vlm ... RESUME=auto` when make started it, else
    this process's own command line with ``--resume auto``."""
    import shlex

    if os.environ.get(RERUN_ENV):
        return f"{os.environ[RERUN_ENV]} RESUME=auto"
    python = sys.executable
    if python.startswith(os.getcwd() + os.sep):
        python = os.path.relpath(python)
    return shlex.join([python, "-m", "vlm.train", "--config", args.config, *(["--no-eval"] if args.no_eval else []),
                       *args.overrides, "--resume", "auto"])


def say(line: str) -> None:
    """One line on stderr in one write: under torchrun every rank writes to the same pipe, and print's
    separate write of the newline lets two ranks' lines run together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class Interrupts:
    """Ctrl-C (or torchrun passing its SIGINT on) while ``main`` runs: the first raises KeyboardInterrupt,
    which ``main`` turns into one line; one arriving once an error is being reported (``exiting``) is
    only recorded, so that no traceback cuts into that line; a second one ends the process at once.
    A context manager: the previous handler is back afterwards (``main`` also runs inside tests)."""

    def __init__(self):
        self.received: list[int] = []
        self.exiting = False
        self.resume_command = "the same command with --resume auto"  # main sets the exact one
        self._previous = None

    def __enter__(self) -> Interrupts:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():  # only there can a handler be set
            self._previous = signal.signal(signal.SIGINT, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        import signal

        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _on_signal(self, signum, frame) -> None:
        self.received.append(signum)
        if len(self.received) > 1:
            _exit_now(INTERRUPTED)
        if not self.exiting:
            raise KeyboardInterrupt

    def report(self, cfg, trainer) -> int:
        """One line (per rank) naming where the run stopped and what to run next."""
        from vlm.training.checkpoint import find_checkpoint

        self.exiting = True
        rank = trainer.rank if trainer is not None else int(os.environ.get("RANK", 0))
        world = trainer.world_size if trainer is not None else int(os.environ.get("WORLD_SIZE", 1))
        where = f"at step {trainer.step}" if trainer is not None else "before the first step"
        newest = find_checkpoint(cfg.ckpt_dir)
        if newest is None:
            hint = f"no checkpoint in {cfg.ckpt_dir} yet: rerun the same command to start again"
        elif world > 1:  # under a launcher: its own command line is not known here
            hint = f"newest checkpoint {newest}: rerun with --resume auto"
        else:
            hint = f"newest checkpoint {newest}; continue with: {self.resume_command}"
        say(f"{f'rank {rank}: ' if world > 1 else ''}interrupted {where}; {hint}")
        return INTERRUPTED


def main(argv=None, extra_callbacks=()) -> int:
    """The run; ``extra_callbacks`` run before the default ones (``python -m vlm.reliability.train``
    passes its fault injection here). Returns the exit code (``INTERRUPTED`` after Ctrl-C)."""
    args = parse_args(argv)
    _quiet_imports()
    from vlm.modeling.config_base import ConfigError
    from vlm.modeling.safe_loading import NotJSONError

    try:
        cfg = preflight(args)
    except (ConfigError, FileNotFoundError, NotJSONError) as err:
        say(f"error: {err}")
        return 2
    with Interrupts() as interrupts:
        interrupts.resume_command = resume_command(args)
        return _run(args, cfg, extra_callbacks, interrupts)


def _run(args, cfg, extra_callbacks, interrupts: Interrupts) -> int:
    from vlm.modeling.config_base import ConfigError
    from vlm.modeling.safe_loading import NotJSONError
    from vlm.training.checkpoint import CheckpointWriteError, ResumeError, find_checkpoint

    trainer = None
    try:
        try:
            from vlm.training.callbacks.defaults import default_callbacks
            from vlm.training.trainer import NonFiniteAbort, Trainer

            trainer = Trainer(cfg, resume=args.resume, callbacks=[*extra_callbacks, *default_callbacks()])
        except (ConfigError, FileNotFoundError, NotJSONError, ResumeError) as err:
            interrupts.exiting = True
            say(f"error: {err}")
            return 2
        from data_pipelines.mixture import TooMuchBadData
        from vlm.training.distributed import collective_failure

        try:
            trainer.fit()
            trainer.finish()
            code = 0
        except TooMuchBadData as err:  # the user's data, not a crash: one line, no traceback
            interrupts.exiting = True
            say(f"error: {err}")
            code = 2
        except NonFiniteAbort as err:
            interrupts.exiting = True
            say(f"error: {err}")
            code = 3
        except CheckpointWriteError as err:
            interrupts.exiting = True
            if trainer.is_main:  # every rank holds the same message
                say(f"error: {err}")
            code = 5
        except Exception as err:
            why = collective_failure(err)
            if why is None:
                raise
            interrupts.exiting = True
            if interrupts.received:  # Ctrl-C reached this rank too: the peer left because of it, not a fault
                _exit_now(interrupts.report(cfg, trainer))
            say(f"error: rank {trainer.rank}: lost the other ranks at step {trainer.step} ({why}); one died or "
                f"stalled past dist_timeout_s={cfg.dist_timeout_s}. Newest complete checkpoint: "
                f"{find_checkpoint(cfg.ckpt_dir) or 'none'}. Restart all ranks with --resume auto")
            _exit_now(4)  # the process group is broken: skip interpreter teardown, which could block on it
        trainer.close()
        trainer.engine.destroy()  # DeepSpeed's own teardown: hooks and pending ZeRO-3 work released
        return code
    except KeyboardInterrupt:
        return interrupts.report(cfg, trainer)


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_process(code: int) -> None:
    """The program's end (``__main__`` of vlm.train and vlm.reliability.train): after an interrupt
    at once (the other ranks may be gone: a collective in teardown could block), else with the
    process groups released first."""
    if code == INTERRUPTED:
        _exit_now(code)
    _release_process_groups()
    sys.exit(code)


def _release_process_groups() -> None:
    """The program's last step (not ``main``'s: tests call it in one process): with the trainer
    gone, destroy the process groups before the interpreter does. Left to interpreter teardown,
    gloo's worker threads can outlive what they hold and abort the process ("terminate called
    without an active exception")."""
    import gc

    torch = sys.modules.get("torch")
    if torch is None:  # stopped before torch was loaded (bad input): no process group to release
        return
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    exit_process(main())
