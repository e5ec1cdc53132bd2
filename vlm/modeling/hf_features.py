"""Which transformers generation internals this install has (see ``features``; 5.17 to 5.25).

* The model-kwargs key under which ``generate`` keeps, updates and beam-reorders the cache:
  ``cache`` where ``transformers.generation.utils.ALL_CACHE_NAMES`` has it (newer releases), else
  ``past_key_values``. ``ConceptMoEForCausalLM`` stores its ``ConceptCache`` under that key and
  accepts it under either name.
"""
from __future__ import annotations

import functools
import logging

log = logging.getLogger("vlm.features")


@functools.cache
def generation_cache_key() -> str:
    from transformers.generation import utils
    key = "cache" if "cache" in getattr(utils, "ALL_CACHE_NAMES", ()) else "past_key_values"
    log.info("features: transformers generate() keeps the cache as model_kwargs[%r]", key)
    return key


def returned_cache(out):
    """The ``ConceptCache`` of a ``generate(..., return_dict_in_generate=True)`` output, whichever name
    this transformers gives it (``out.cache`` or ``out.past_key_values``)."""
    return getattr(out, generation_cache_key())


def report() -> list[str]:
    import transformers
    return [f"transformers {transformers.__version__}: generate() keeps the cache as "
            f"model_kwargs[{generation_cache_key()!r}]"]
