"""ConceptMoE-VL: vision-language models on a ConceptMoE backbone.

``import vlm`` registers the model classes with the transformers Auto classes.
"""
from vlm.config import ConceptMoEConfig, ConfigError
from vlm.modeling.hf import ConceptMoEForCausalLM, ConceptMoEOutput
from vlm.modeling.vlm_model import ConceptMoEVLMForConditionalGeneration, ImageTokenMismatch
from vlm.config.vlm import ConceptMoEVLMConfig

__all__ = ["ConceptMoEConfig", "ConfigError", "ConceptMoEForCausalLM", "ConceptMoEOutput",
           "ConceptMoEVLMConfig", "ConceptMoEVLMForConditionalGeneration", "ImageTokenMismatch",
           "ConceptMoEVLMProcessor"]


def __getattr__(name):  # the processor pulls in the tokenizer stack; load it on first use
    if name == "ConceptMoEVLMProcessor":
        from vlm.processing import ConceptMoEVLMProcessor
        return ConceptMoEVLMProcessor
    raise AttributeError(name)
