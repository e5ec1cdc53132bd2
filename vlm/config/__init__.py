"""Configs: the one mechanism (``core``: typed sections, YAML, overrides, one-line errors) and the
model, VLM, training configs built on it."""
from vlm.config.core import ConfigError, load_yaml, read_yaml
from vlm.config.model import (
    FIELD_OWNER,
    AttentionConfig,
    ChunkingConfig,
    ConceptMoEConfig,
    LayoutConfig,
    MoEConfig,
)

__all__ = ["AttentionConfig", "ChunkingConfig", "ConceptMoEConfig", "ConfigError", "FIELD_OWNER", "LayoutConfig",
           "MoEConfig", "load_yaml", "read_yaml"]
