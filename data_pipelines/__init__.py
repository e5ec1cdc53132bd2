"""Data package of ConceptMoE-VL: readers, chat tokenisation, collators, mixtures, default data.

`build_loader` (mixture.py) wires them from a data config; the flow and the formats are in
data_pipelines/README.md.
"""

import importlib

# name -> module (ours, or the model package's: chat template, image transform); imported lazily so `python -m data_pipelines.default_data` stays light
_EXPORTS = {
    "CHAT_TEMPLATE": "vlm.modeling.chat_template", "ChatTokenizer": "vlm.modeling.chat_template",
    "TokenizationMismatch": "vlm.modeling.chat_template", "TemplateMismatch": "vlm.modeling.chat_format",
    "prepare_llm_tokenizer": ".llm_tokenizer", "chat_stop_token": ".llm_tokenizer",
    "PackingCollator": ".collate",
    "PadCollator": ".collate", "truncate_sample": ".collate", "IGNORE_INDEX": "vlm.modeling.chat_common",
    "SPECIAL_TOKENS": "vlm.modeling.chat_common", "Skip": "vlm.modeling.chat_common", "SampleEncoder": ".encode",
    "ImageTransform": "vlm.modeling.image_transform", "load_image": "vlm.modeling.image_transform",
    "to_rgb": "vlm.modeling.image_transform",
    "LlavaJsonDataset": ".llava_json", "MixtureDataset": ".mixture", "MixtureLoader": ".mixture",
    "TooMuchBadData": ".mixture", "build_loader": ".mixture", "TextCorpusDataset": ".text_corpus",
    "WebDatasetShards": ".webdataset_shards", "WebDatasetSource": ".stream_source",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
