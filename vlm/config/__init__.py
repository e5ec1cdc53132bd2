"""The training config (``train.py``), built on the model package's config mechanism
(``vlm/modeling/config_base.py``: typed sections, YAML, overrides, one-line errors)."""
