"""The modes benchmarks/inference.py times: one way each to run a model for generation (start a cache,
prefill it, one decode step, its KV bytes). Ours with ``decode="compiled"`` /
``"cudagraph"`` (CUDA only) runs the captured step; the benchmark's tables take their rows from the modes
that ran.
"""
from __future__ import annotations

import torch

from benchmarks.hf_pair import kv_bytes_hf, kv_bytes_ours

RATIO = 2.0  # the converted ConceptMoE's R (boundaries fixed there)


class Mode:
    """One way to run the model: ``start`` a cache for ``B`` rows and ``cap`` positions, ``prefill`` it
    with a prompt (returns the last logits [B, V]), one decode ``step`` (tokens [B, 1] at position
    ``pos``; returns logits [B, V]), the cache's KV bytes after ``filled`` positions."""
    label = ""
    counted = True  # ops / syncs counted by the dispatcher (False: a compiled graph's fused kernels)
    prefills = True  # timed in the prefill table (False: its prefill is another mode's, e.g. eager)

    def start(self, B: int, cap: int):
        raise NotImplementedError

    def prefill(self, cache, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def step(self, cache, tok_B1: torch.Tensor, pos: int) -> torch.Tensor:
        raise NotImplementedError

    def kv(self, cache, filled: int) -> dict:
        raise NotImplementedError


class Ours(Mode):
    """Our model's cached decoding (``start_decoding`` / ``prefill`` / ``step``); ``decode``: how the steps
    run (generation.DECODE_MODES: "eager", "static", "compiled", "cudagraph"); a captured one is not
    counted (its kernels are not dispatched ATen ops) and its prefill is the eager one's."""

    def __init__(self, model, label: str, decode: str = "eager"):
        self.model, self.label, self.decode = model, label, decode
        self.counted = decode in ("eager", "static")
        self.prefills = decode == "eager"

    def start(self, B, cap):
        return self.model.start_decoding(B, cap, decode=self.decode)

    def prefill(self, cache, ids):
        return self.model.prefill(cache, ids)

    def step(self, cache, tok_B1, pos):
        return self.model.step(cache, tok_B1[:, 0])

    def kv(self, cache, filled):
        kv = kv_bytes_ours(cache)
        return {"allocated_bytes": kv["allocated_bytes"], "held_bytes": kv["held_bytes"]}


class HFStatic(Mode):
    """transformers with a ``StaticCache`` (reset, not reallocated, between prefills, as its generate
    does); ``compiled``: the decode steps through ``get_compiled_call(CompileConfig())`` as its generate
    runs them, the prefill too where ``compile_prefill`` (else eager, as generate runs it)."""

    def __init__(self, hf, compiled: bool, compile_prefill: bool = False):
        from transformers.generation.configuration_utils import CompileConfig

        self.hf = hf
        self.call = hf.get_compiled_call(CompileConfig()) if compiled else hf.__call__
        self.prefill_call = self.call if compile_prefill else hf.__call__
        self.prefills = compile_prefill or not compiled  # False: its prefill is the eager mode's
        self.counted = not compiled
        self.label = "transformers StaticCache + compile" if compiled else "transformers StaticCache"
        self._caches = {}

    def start(self, B, cap):
        from transformers import StaticCache

        cache = self._caches.get((B, cap))
        if cache is None:
            cache = self._caches[(B, cap)] = StaticCache(config=self.hf.config, max_cache_len=cap)
        else:
            cache.reset()
        return cache

    def prefill(self, cache, ids):
        return self.prefill_call(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]

    def step(self, cache, tok_B1, pos):
        position = torch.full((tok_B1.shape[0], 1), pos, device=tok_B1.device)
        return self.call(input_ids=tok_B1, cache=cache, position_ids=position, use_cache=True).logits[:, -1]

    def kv(self, cache, filled):
        alloc = kv_bytes_hf(cache)["allocated_bytes"]
        return {"allocated_bytes": alloc, "held_bytes": alloc * filled // cache.layers[0].max_cache_len}


MODES = {  # name -> Mode, built from (plain MoE, ConceptMoE, transformers model, the command line)
    "ours": lambda plain, con, hf, args: Ours(plain, "ours, plain MoE"),
    "ours_compiled": lambda plain, con, hf, args: Ours(plain, "ours, plain MoE, compiled decode", "compiled"),
    "ours_cudagraph": lambda plain, con, hf, args: Ours(plain, "ours, plain MoE, CUDA-graph decode", "cudagraph"),
    "ours_R2": lambda plain, con, hf, args: Ours(con, f"ours, ConceptMoE R = {RATIO:g} (converted)"),
    "hf_static": lambda plain, con, hf, args: HFStatic(hf, compiled=False),
    "hf_static_compiled": lambda plain, con, hf, args: HFStatic(hf, compiled=True,
                                                                compile_prefill=args.compile_prefill),
}
