"""`python -m vlm.chat` as a user runs it, on a tiny export, driven through stdin: every reply is
model.generate's greedy answer to the prompt the chat template gives for the conversation so far
(/image, history, /reset included); bad input is one line on stderr and exit 2."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from _eval_helpers import REPO, session_checkpoint
from PIL import Image

IMAGE = REPO / "data" / "default" / "images" / "digits" / "7.png"
N_NEW = 6


def chat(export, stdin: str, *extra) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.run([sys.executable, "-m", "vlm.chat", "--model", str(export), "--max-new-tokens",
                           str(N_NEW), *extra], input=stdin, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return session_checkpoint(tmp_path_factory)


def test_a_scripted_conversation_gets_the_greedy_replies(export):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    # importing them registers our classes with the auto classes
    import vlm.modeling.modeling_conceptmoe_vl
    import vlm.modeling.processing_conceptmoe_vl  # noqa: F401

    model = AutoModelForImageTextToText.from_pretrained(export).eval()
    processor = AutoProcessor.from_pretrained(export)
    picture = Image.open(IMAGE).convert("RGB")

    def greedy(messages, images=None):
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        batch = processor(text=text, images=images, chat=False)
        ids = model.generate(**batch, max_new_tokens=N_NEW, do_sample=False)
        return processor.decode(ids[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)

    first = greedy([{"role": "user", "content": "<image>\nWhat digit is this?"}], [picture])
    history = [{"role": "user", "content": "<image>\nWhat digit is this?"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "Are you sure?"}]
    second = greedy(history, [picture])
    third = greedy([{"role": "user", "content": "Hello"}])
    script = f"/image {IMAGE}\nWhat digit is this?\nAre you sure?\n/reset\nHello\n/quit\nnever sent\n"
    proc = chat(export, script)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == f"{first}\n{second}\n{third}\n"
    assert "image attached" in proc.stderr and "history cleared" in proc.stderr


def test_show_concepts_adds_a_marked_line_per_reply(export):
    proc = chat(export, "Hello\nAgain\n", "--show-concepts")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert [line.startswith("concepts: ") for line in lines] == [False, True, False, True]
    assert all(re.search(r" \(\d+ boundar(y|ies); R=\d+\.\d\d over prompt \+ reply\)$", line)
               for line in lines[1::2]), lines


@pytest.mark.parametrize("make_input, message", [
    (lambda tmp: (["--model", str(tmp / "missing")], "hi\n"), "no such folder"),
    (lambda tmp: ([], f"/image {tmp / 'nope.png'}\nhi\n"), "missing image"),
    (lambda tmp: ([], f"/image {tmp / 'broken.png'}\nhi\n"), "corrupt image"),
])
def test_bad_input_is_one_line_and_exit_2(export, tmp_path, make_input, message):
    (tmp_path / "broken.png").write_bytes(b"not a picture")
    argv, stdin = make_input(tmp_path)
    proc = chat(export, stdin, *argv)  # a second --model replaces the first
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr


def test_the_export_s_own_code_gives_the_same_replies(export):
    """--trust-remote-code: the model and processor classes from the export's files (auto_map)."""
    ours, remote = chat(export, "Hello\n"), chat(export, "Hello\n", "--trust-remote-code")
    assert ours.returncode == remote.returncode == 0, remote.stderr[-2000:]
    assert remote.stdout == ours.stdout and ours.stdout.strip()


def test_ctrl_c_mid_reply_leaves_cleanly(export):
    """SIGINT while a long reply streams: the reply stops, exit status 0, no traceback."""
    import signal
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.Popen([sys.executable, "-m", "vlm.chat", "--model", str(export), "--max-new-tokens", "20000"],
                            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proc.stdin.write(b"Hello\n")
        proc.stdin.flush()
        assert proc.stdout.read(1)  # the reply has started
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    assert b"Traceback" not in err and time.monotonic() - started < 60
