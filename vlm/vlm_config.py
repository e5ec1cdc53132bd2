"""Moved to ``vlm.config.vlm`` (kept while call sites move)."""
from vlm.config.vlm import TOKEN_FIELDS as _TOKEN_FIELDS  # noqa: F401
from vlm.config.vlm import ConceptMoEVLMConfig  # noqa: F401
