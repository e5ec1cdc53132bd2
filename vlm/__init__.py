"""ConceptMoE-VL: vision-language models on a ConceptMoE backbone.

``import vlm`` registers the model, config, processor and image processor classes with the
transformers Auto classes.
"""
from vlm.config import ConceptMoEConfig, ConfigError
from vlm.modeling.hf import ConceptMoEForCausalLM, ConceptMoEOutput
from vlm.modeling.vlm_model import ConceptMoEVLMForConditionalGeneration, ImageTokenMismatch
from vlm.config.vlm import ConceptMoEVLMConfig
from vlm.processing import ConceptMoEVLMProcessor

__all__ = ["ConceptMoEConfig", "ConfigError", "ConceptMoEForCausalLM", "ConceptMoEOutput",
           "ConceptMoEVLMConfig", "ConceptMoEVLMForConditionalGeneration", "ImageTokenMismatch",
           "ConceptMoEVLMProcessor"]

