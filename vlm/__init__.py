"""ConceptMoE-VL: vision-language models on a ConceptMoE backbone.

``import vlm`` is light (no torch, no transformers), so that ``python -m vlm.train --help`` and its
argument errors do not wait for them. The public classes load on first use (``from vlm import
ConceptMoEConfig``, ``vlm.ConceptMoEVLMProcessor``), and that first use registers the model, config,
processor and image processor classes with the transformers Auto classes; code that goes only through
the Auto classes calls ``vlm.register_auto_classes()`` first.
"""
from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING


class _DropDeepSpeedCpuNotice(logging.Filter):
    """DeepSpeed warns "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to
    detect it." from every process without a GPU: transformers' generation utilities import it (through
    accelerate) on every model import. Our own lines say the device (``[train] ... on cpu``); this one
    DeepSpeed line is dropped, every other DeepSpeed record passes."""

    NOTICE = "Setting accelerator to CPU."

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.NOTICE)


# on DeepSpeed's own logger ("DeepSpeed", deepspeed/utils/logging.py), before anything imports DeepSpeed: the
# notice comes at its import, and DeepSpeed resets the logger's level when it creates it (a filter stays)
_DS_LOGGER = logging.getLogger("DeepSpeed")
if not any(isinstance(f, _DropDeepSpeedCpuNotice) for f in _DS_LOGGER.filters):
    _DS_LOGGER.addFilter(_DropDeepSpeedCpuNotice())

if TYPE_CHECKING:  # what the lazy names below resolve to, for readers and type checkers
    from vlm.modeling.config_base import ConfigError
    from vlm.modeling.configuration_conceptmoe import ConceptMoEConfig
    from vlm.modeling.configuration_conceptmoe_vl import ConceptMoEVLMConfig
    from vlm.modeling.modeling_conceptmoe import ConceptMoEForCausalLM, ConceptMoEOutput
    from vlm.modeling.modeling_conceptmoe_vl import ConceptMoEVLMForConditionalGeneration, ImageTokenMismatch
    from vlm.modeling.processing_conceptmoe_vl import ConceptMoEVLMProcessor

# public name -> its module in the model package
_PUBLIC = {"ConceptMoEConfig": "configuration_conceptmoe", "ConfigError": "config_base",
           "ConceptMoEForCausalLM": "modeling_conceptmoe", "ConceptMoEOutput": "modeling_conceptmoe",
           "ConceptMoEVLMForConditionalGeneration": "modeling_conceptmoe_vl",
           "ImageTokenMismatch": "modeling_conceptmoe_vl", "ConceptMoEVLMConfig": "configuration_conceptmoe_vl",
           "ConceptMoEVLMProcessor": "processing_conceptmoe_vl"}
# the modules whose import registers our classes with the Auto classes (their last lines)
_REGISTERING = ("configuration_conceptmoe_vl", "modeling_conceptmoe", "modeling_conceptmoe_vl",
                "processing_conceptmoe_vl", "image_processing_conceptmoe_vl")
_LIGHT = {"ConfigError"}  # needs neither torch nor transformers: loads alone

__all__ = ["ConceptMoEConfig", "ConfigError", "ConceptMoEForCausalLM", "ConceptMoEOutput",  # = _PUBLIC's keys
           "ConceptMoEVLMConfig", "ConceptMoEVLMForConditionalGeneration", "ImageTokenMismatch",
           "ConceptMoEVLMProcessor", "register_auto_classes"]


def register_auto_classes() -> None:
    """Register our config, model, processor and image processor with the transformers Auto classes
    (``AutoConfig``, ``AutoModelForCausalLM``, ``AutoModel``, ``AutoModelForImageTextToText``,
    ``AutoProcessor``, ``AutoImageProcessor``). Imports torch and transformers; idempotent."""
    for name in _REGISTERING:
        importlib.import_module(f"vlm.modeling.{name}")


def __getattr__(name: str):
    """PEP 562: a public class on first use (registering every class first), then a plain attribute."""
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'vlm' has no attribute {name!r}")
    if name not in _LIGHT:
        register_auto_classes()
    value = getattr(importlib.import_module(f"vlm.modeling.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
