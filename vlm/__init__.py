"""ConceptMoE-VL: vision-language models on a ConceptMoE backbone.

``import vlm`` registers the model classes with the transformers Auto classes.
"""
from vlm.config import ConceptMoEConfig, ConfigError
from vlm.modeling.hf import ConceptMoEForCausalLM, ConceptMoEOutput

__all__ = ["ConceptMoEConfig", "ConfigError", "ConceptMoEForCausalLM", "ConceptMoEOutput"]
