"""Test helpers for the server (vlm/serving/server.py): a tiny export's engine + app, and the app served
by uvicorn in a thread of this process on 127.0.0.1 (a port the OS picks), stopped when the block ends."""
from __future__ import annotations

import base64
import contextlib
import socket
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "data" / "default" / "images" / "digits"


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()


def digit_png(tmp: Path, name: str = "digit.png", color=(200, 30, 30)) -> Path:
    """A PNG: a digit of data/default when built, else a drawn one."""
    src = DIGITS / "3.png"
    out = tmp / name
    if src.is_file():
        out.write_bytes(src.read_bytes())
    else:
        from PIL import Image

        Image.new("RGB", (28, 28), color).save(out)
    return out


def load_export(folder):
    from vlm.modeling.modeling_conceptmoe_vl import (
        ConceptMoEVLMForConditionalGeneration,
    )
    from vlm.modeling.processing_conceptmoe_vl import ConceptMoEVLMProcessor

    model = ConceptMoEVLMForConditionalGeneration.from_pretrained(str(folder)).float().eval()
    return model, ConceptMoEVLMProcessor.from_pretrained(str(folder))


@contextlib.contextmanager
def serving(app, timeout: float = 30.0):
    """Yield the base URL of ``app`` served on 127.0.0.1; the server thread is stopped and joined after."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
