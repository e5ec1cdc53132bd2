"""``python -m vlm.serve --model DIR``: an OpenAI-compatible chat server on a ConceptMoE-VL export
(vlm/serving/: the continuous-batching engine and the FastAPI app). Binds 127.0.0.1 unless told
otherwise; ``--api-key`` (or the ``VLM_API_KEY`` environment variable) guards ``/v1/*``. SIGTERM / Ctrl-C:
no new requests; the waiting and in-flight ones finish, then the process exits. See docs/serving.md."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("vlm.serve")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m vlm.serve", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an export folder (the trainer's runs/<name>/hf/)")
    ap.add_argument("--served-model-name", default=None, help="the model id clients send (default: the folder name)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* "
                    "(prefer the VLM_API_KEY environment variable: a command line is visible to other users)")
    ap.add_argument("--image-root", default=None, help="serve local image files under this folder (default: none)")
    ap.add_argument("--max-model-len", type=int, default=2048, help="token slots per request: prompt + max_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="rows decoded together at most")
    ap.add_argument("--max-queue", type=int, default=256, help="waiting requests before 429")
    ap.add_argument("--kv-budget-mb", type=float, default=None,
                    help="KV cache memory all rows may hold (default: room for --max-num-seqs requests)")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take (0: none)")
    ap.add_argument("--max-image-mb", type=float, default=10.0, help="largest image accepted")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--decode", default=None, choices=("eager", "graphs"),
                    help="the fixed-shape decode step per batch bucket: run eagerly, or captured as CUDA graphs "
                    "(CUDA, bfloat16); default: graphs only where the GPU check proved them (gpu_verdicts.json)")
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return ap.parse_args(argv)


def fail(message: str) -> None:
    print(f"vlm.serve: {message}", file=sys.stderr)
    raise SystemExit(2)


def load(args):
    """(model, processor) of the export; a text-only export is refused (this server takes chat with images)."""
    import torch

    from vlm.modeling.modeling_conceptmoe_vl import (
        ConceptMoEVLMForConditionalGeneration,
    )
    from vlm.modeling.processing_conceptmoe_vl import ConceptMoEVLMProcessor

    folder = Path(args.model)
    config = folder / "config.json"
    if not config.is_file():
        fail(f"--model {folder}: no config.json (an export folder, e.g. runs/<name>/hf/)")
    model_type = json.loads(config.read_text()).get("model_type")
    if model_type != "conceptmoe_vlm":
        fail(f"--model {folder}: model_type {model_type!r}; this server serves ConceptMoE-VL exports (conceptmoe_vlm)")
    dtype = getattr(torch, args.dtype)
    model = ConceptMoEVLMForConditionalGeneration.from_pretrained(str(folder), dtype=dtype).to(args.device).eval()
    return model, ConceptMoEVLMProcessor.from_pretrained(str(folder))


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    api_key = args.api_key or os.environ.get("VLM_API_KEY") or None
    image_root = Path(args.image_root).resolve() if args.image_root else None
    if image_root is not None and not image_root.is_dir():
        fail(f"--image-root {args.image_root}: not a folder")
    if args.max_model_len < 2 or args.max_num_seqs < 1 or args.max_queue < 1:
        fail("--max-model-len must be >= 2, --max-num-seqs and --max-queue >= 1")
    import uvicorn

    from vlm.serving.engine import Engine
    from vlm.serving.server import create_app

    model, processor = load(args)
    gen = model.generation_config
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    budget = None if args.kv_budget_mb is None else int(args.kv_budget_mb * 2**20)
    try:
        engine = Engine(model, processor.tokenizer, args.max_model_len, args.max_num_seqs, args.max_queue, budget,
                        eos_ids=[e for e in eos if e is not None], decode=args.decode)
    except ValueError as e:
        fail(str(e))
    name = args.served_model_name or Path(args.model).resolve().name
    app = create_app(engine, processor, name, api_key, image_root, int(args.max_image_mb * 2**20),
                     default_temperature=float(gen.temperature or 1.0) if gen.do_sample else 0.0,
                     request_timeout=args.request_timeout or None)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           lifespan="off"), engine)
    log.info("serving %s on http://%s:%d (KV %d B per request, budget %d B, %d rows, decode %s, api key %s)", name,
             args.host, args.port, engine.request_bytes, engine.kv_budget, engine.slots.rows, engine.decode,
             "required" if api_key else "off")
    engine.start()
    try:
        server.run()
    finally:
        engine.stop(drain=True, timeout=60)


class DrainingServer:
    """uvicorn's server with SIGTERM / SIGINT first closing the engine's door: no new requests (503), while
    uvicorn's graceful shutdown waits for the in-flight responses to finish."""

    def __new__(cls, config, engine):
        import uvicorn

        class _Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                with engine.cond:
                    engine.draining = True
                super().handle_exit(sig, frame)

        return _Server(config)


if __name__ == "__main__":
    main()
