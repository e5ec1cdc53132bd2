"""Talk to an exported VLM in the terminal: replies streamed token by token, multi-turn history in the
model's chat template, images attached with /image.

    python -m vlm.chat --model runs/train-vlm/hf

Commands: /image PATH (the next message carries the image; repeat for several), /reset (forget the
history), /quit (or EOF, Ctrl-C). When stdin is not a terminal, lines are read from it (commands and
messages) and each reply is written to stdout followed by a newline; status lines go to stderr.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

HELP_COMMANDS = """commands:
  /image PATH   attach an image to the next message (repeat for several)
  /reset        forget the conversation (and attached images)
  /quit         leave (also EOF / Ctrl-D, Ctrl-C)
  anything else is a message to the model

bad input (a missing model folder, an image path that does not exist or does not decode, an unknown
command) is one line on stderr and exit status 2; in a terminal a bad /image or command is reported
and the chat goes on.

--show-concepts: after each reply, a line 'concepts: ...' repeats the reply with '|' before every token
that starts a concept (the boundaries of the model's forward over prompt + reply) and the achieved
compression R."""


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m vlm.chat", description=__doc__.splitlines()[0],
                                 epilog=HELP_COMMANDS, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="export folder (model + processor, e.g. runs/train-vlm/hf)")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="load the export's own code (auto_map) instead of this package's classes")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens per reply at most (default 128)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (needs --temperature > 0)")
    ap.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    ap.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (CUDA when there is one)")
    ap.add_argument("--show-concepts", action="store_true", help="mark the reply's concept boundaries (see below)")
    return ap.parse_args(argv)


def check_args(args) -> str | None:
    """The first problem with the options as one line, else None (torch is imported for --device only)."""
    if not os.path.isdir(args.model):
        return f"--model {args.model}: no such folder"
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        return f"--model {args.model}: no config.json (not an export folder)"
    if args.max_new_tokens < 1:
        return f"--max-new-tokens must be at least 1, got {args.max_new_tokens}"
    if not args.temperature >= 0:
        return f"--temperature must be >= 0, got {args.temperature}"
    if not 0 < args.top_p <= 1:
        return f"--top-p must be in (0, 1], got {args.top_p}"
    if args.top_p != 1 and args.temperature == 0:
        return "--top-p needs --temperature > 0 (temperature 0 is greedy decoding)"
    if args.device != "auto":
        import torch

        try:
            device = torch.device(args.device)
        except (RuntimeError, ValueError):
            return f"--device {args.device!r} is not a device (cpu, cuda, cuda:N or auto)"
        if device.type == "cuda" and not torch.cuda.is_available():
            return f"--device {args.device}: CUDA is not available here"
        if device.type not in ("cpu", "cuda"):
            return f"--device {args.device}: only cpu and cuda are supported"
    return None


def load(args, torch):
    """(model in eval mode on the chosen device, processor) of the export."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    if not args.trust_remote_code:
        import vlm

        vlm.register_auto_classes()  # this package's classes behind the Auto classes
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForImageTextToText.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    processor = AutoProcessor.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    return model.to(device).eval(), processor


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


class CtrlC:
    """Ctrl-C (SIGINT) while a reply is being generated sets the session's stop event: the reply ends at its
    next token, the chat prints what came and leaves (``requested``). Raising KeyboardInterrupt there instead
    would interrupt the main thread inside the streamer's queue, whose lock an interrupted wait can leave held,
    blocking the generating thread. Elsewhere (at the prompt, loading) Ctrl-C raises KeyboardInterrupt as
    usual. ``install`` only from the main thread (where Python runs signal handlers)."""

    def __init__(self, session):
        self.session, self.requested = session, False

    def __call__(self, signum=None, frame=None) -> None:
        worker = self.session.worker
        if worker is None or not worker.is_alive():
            raise KeyboardInterrupt
        self.requested = True
        self.session.stop.set()

    def install(self) -> CtrlC:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self)
        return self


def run(session, lines, interactive: bool, show_concepts: bool, out=None, err=None,
        ctrl_c: CtrlC | None = None) -> int:
    """The chat loop over ``lines`` (an iterator of input lines); returns the exit status. ``out`` / ``err``:
    sys.stdout / sys.stderr as they are at the call; ``ctrl_c``: leave (status 0) after a reply it stopped."""
    from vlm.chat_session import BadInput

    out, err = out or sys.stdout, err or sys.stderr

    def refuse(message: str) -> int | None:
        print(f"error: {message}", file=err)
        return None if interactive else 2

    for line in lines:
        line = line.rstrip("\r\n")
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            command, _, rest = text.partition(" ")
            if command == "/quit":
                return 0
            if command == "/reset":
                session.reset()
                print("(history cleared)", file=err)
            elif command == "/image":
                if not rest.strip():
                    status = refuse("/image needs a path: /image PATH")
                else:
                    try:
                        session.attach(os.path.expanduser(rest.strip()))
                        print(f"(image attached: {rest.strip()}; {len(session.pending)} for the next message)", file=err)
                        status = None
                    except BadInput as bad:
                        status = refuse(str(bad))
                if status is not None:
                    return status
            else:
                status = refuse(f"unknown command {command} (commands: /image PATH, /reset, /quit)")
                if status is not None:
                    return status
            continue
        try:
            session.check_message(line)
        except BadInput as bad:
            if refuse(str(bad)) is not None:
                return 2
            continue
        if interactive:
            print("assistant: ", end="", file=out, flush=True)
        session.send(line, on_text=lambda piece: print(piece, end="", file=out, flush=True))
        print(file=out, flush=True)
        if ctrl_c is not None and ctrl_c.requested:
            print(file=err)
            return 0
        if show_concepts:
            try:
                marked, count, stats = session.concept_marks()
            except BadInput as bad:  # a model without chunking: the option cannot be served
                print(f"error: {bad}", file=err)
                return 2
            print(f"concepts: {marked}  ({count} {'boundary' if count == 1 else 'boundaries'}; "
                  f"R={stats['ratio']:.2f} over prompt + reply)", file=out, flush=True)
    return 0


def terminal_lines(prompt: str = "you: "):
    """Lines typed at the terminal (readline editing where Python has it) until EOF."""
    try:
        import readline  # noqa: F401  line editing and history for input()
    except ImportError:
        pass
    while True:
        try:
            yield input(prompt)
        except EOFError:
            print()
            return


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = check_args(args)
    if problem:
        return fail(problem)
    import torch
    from transformers import set_seed

    from vlm.chat_session import ChatSession

    try:
        model, processor = load(args, torch)
    except (OSError, ValueError, KeyError) as err:
        return fail(f"cannot load {args.model}: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
    if args.show_concepts and not getattr(getattr(model.config, "text_config", None), "chunking", False):
        return fail("--show-concepts: this model has chunking switched off (no concepts to mark)")
    set_seed(args.seed)
    session = ChatSession(model, processor, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_p=args.top_p)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {args.model} on {next(model.parameters()).device} "
              "(/image PATH, /reset, /quit; --help for more)", file=sys.stderr)
    try:
        return run(session, terminal_lines() if interactive else sys.stdin, interactive, args.show_concepts,
                   ctrl_c=CtrlC(session).install())
    except KeyboardInterrupt:  # Ctrl-C: stop a reply being generated and leave
        session.interrupt()
        print(file=sys.stderr)
        return 0


if __name__ == "__main__":
    sys.exit(main())
