"""Data package of ConceptMoE-VL: readers, chat tokenisation, collators, mixtures, default data.

`build_loader` (mixture.py) wires them from a data config; the flow and the formats are in
data_pipelines/README.md.
"""

import importlib

# name -> submodule; imported lazily so `python -m data_pipelines.default_data` stays light
_EXPORTS = {
    "CHAT_TEMPLATE": "chat_template", "ChatTokenizer": "chat_template",
    "TokenizationMismatch": "chat_template", "TemplateMismatch": "chat_format",
    "prepare_llm_tokenizer": "llm_tokenizer", "chat_stop_token": "llm_tokenizer",
    "PackingCollator": "collate",
    "PadCollator": "collate", "truncate_sample": "collate", "IGNORE_INDEX": "common",
    "SPECIAL_TOKENS": "common", "Skip": "common", "SampleEncoder": "encode",
    "ImageTransform": "images", "load_image": "images", "to_rgb": "images",
    "LlavaJsonDataset": "llava_json", "MixtureDataset": "mixture", "MixtureLoader": "mixture",
    "TooMuchBadData": "mixture", "build_loader": "mixture", "TextCorpusDataset": "text_corpus",
    "WebDatasetShards": "webdataset_shards", "WebDatasetSource": "stream_source",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
