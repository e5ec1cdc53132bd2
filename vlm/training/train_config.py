"""Moved to ``vlm.config.train`` (kept while call sites move)."""
from vlm.config.core import deep_merge, parse_override, read_yaml, set_dotted  # noqa: F401
from vlm.config.train import (  # noqa: F401
    DATA_LOADER_KEYS,
    PARTS,
    REPO_ROOT,
    STAGES,
    ZERO_PRESETS,
    TrainConfig,
    load_train_config,
)
