"""ConceptMoE-VL: vision-language models on a ConceptMoE backbone.

``import vlm`` registers the model, config, processor and image processor classes with the
transformers Auto classes.
"""
from vlm.modeling.configuration_conceptmoe import ConceptMoEConfig
from vlm.modeling.config_base import ConfigError
from vlm.modeling.modeling_conceptmoe import ConceptMoEForCausalLM, ConceptMoEOutput
from vlm.modeling.modeling_conceptmoe_vl import ConceptMoEVLMForConditionalGeneration, ImageTokenMismatch
from vlm.modeling.configuration_conceptmoe_vl import ConceptMoEVLMConfig
from vlm.modeling.processing_conceptmoe_vl import ConceptMoEVLMProcessor

__all__ = ["ConceptMoEConfig", "ConfigError", "ConceptMoEForCausalLM", "ConceptMoEOutput",
           "ConceptMoEVLMConfig", "ConceptMoEVLMForConditionalGeneration", "ImageTokenMismatch",
           "ConceptMoEVLMProcessor"]

