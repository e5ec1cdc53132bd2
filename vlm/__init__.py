"""ConceptMoE-VL: vision-language models on a ConceptMoE backbone.

``import vlm`` registers the model, config, processor and image processor classes with the
transformers Auto classes.
"""
import logging


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

from vlm.modeling.configuration_conceptmoe import ConceptMoEConfig  # noqa: E402
from vlm.modeling.config_base import ConfigError  # noqa: E402
from vlm.modeling.modeling_conceptmoe import ConceptMoEForCausalLM, ConceptMoEOutput  # noqa: E402
from vlm.modeling.modeling_conceptmoe_vl import ConceptMoEVLMForConditionalGeneration, ImageTokenMismatch  # noqa: E402
from vlm.modeling.configuration_conceptmoe_vl import ConceptMoEVLMConfig  # noqa: E402
from vlm.modeling.processing_conceptmoe_vl import ConceptMoEVLMProcessor  # noqa: E402

__all__ = ["ConceptMoEConfig", "ConfigError", "ConceptMoEForCausalLM", "ConceptMoEOutput",
           "ConceptMoEVLMConfig", "ConceptMoEVLMForConditionalGeneration", "ImageTokenMismatch",
           "ConceptMoEVLMProcessor"]

