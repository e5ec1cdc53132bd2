"""``python -m vlm.serve`` as a process: it binds 127.0.0.1, serves the official openai client, SIGTERM lets
an in-flight stream finish (``data: [DONE]``) before the process ends, and its log never holds the API key; a folder
that is no export is one line and exit 2."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
from _data_helpers import tiny_tokenizer
from _eval_helpers import make_tiny_checkpoint
from _train_helpers import kill_tree

from vlm.config.train import REPO_ROOT

KEY = "sk-cli-secret-424242"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited early:\n{proc.stdout.read()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the server did not become healthy")


def test_serve_process_drains_on_sigterm_and_never_logs_the_key(tmp_path):
    tiny_tokenizer(str(tmp_path / "tok"))
    export = make_tiny_checkpoint(tmp_path / "export", tmp_path / "tok")
    port = free_port()
    cmd = [sys.executable, "-m", "vlm.serve", "--model", export, "--port", str(port), "--api-key", KEY,
           "--max-model-len", "256", "--log-level", "debug"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        from openai import OpenAI

        c = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        answer = c.chat.completions.create(model="export", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert answer.choices[0].message.role == "assistant"
        lines, first = [], threading.Event()

        def read_stream():
            body = {"model": "export", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 200,
                    "stream": True, "temperature": 0}
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {KEY}"}) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    first.set()

        reader = threading.Thread(target=read_stream)
        reader.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        reader.join(120)
        out, _ = proc.communicate(timeout=120)
        # uvicorn re-raises the signal after its graceful shutdown: the conventional status of a SIGTERM'd process
        assert proc.returncode == -signal.SIGTERM, out[-3000:]
        assert "Waiting for connections to close" in out
        events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        finish = json.loads(events[-2][6:])["choices"][0]["finish_reason"]
        assert finish in ("length", "stop")  # finished, not cut off
        assert KEY not in out and "required" in out
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.communicate()


def test_not_an_export_is_one_line_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "vlm.serve", "--model", str(tmp_path)], check=False, cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    line = f"vlm.serve: --model {tmp_path}: no config.json (an export folder, e.g. runs/<name>/hf/)"
    assert out.stderr.strip().splitlines() == [line]


def test_decode_graphs_on_cpu_is_one_line_exit_2(tmp_path):
    """``--decode graphs`` (CUDA graphs) on a CPU model: one line naming the way out, exit 2, no traceback."""
    tiny_tokenizer(str(tmp_path / "tok"))
    export = make_tiny_checkpoint(tmp_path / "export", tmp_path / "tok")
    out = subprocess.run([sys.executable, "-m", "vlm.serve", "--model", export, "--decode", "graphs",
                          "--log-level", "warning"], check=False, cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 2, out.stderr[-3000:]
    line = "vlm.serve: decode='graphs' captures the decode step as CUDA graphs: the model is on cpu (use decode='eager')"
    assert out.stderr.strip().splitlines()[-1] == line and "Traceback" not in out.stderr, out.stderr[-3000:]
