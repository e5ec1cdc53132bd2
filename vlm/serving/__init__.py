"""Serving a trained export: a continuous-batching engine over per-row token and concept caches
(engine.py) and an OpenAI-compatible HTTP server on it (server.py; ``python -m vlm.serve``)."""
