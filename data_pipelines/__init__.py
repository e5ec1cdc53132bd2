"""Data package of ConceptMoE-VL: readers, chat tokenisation, collators, mixtures, default data.

Flow of one training sample:

    reader[i] (llava_json / text_corpus / webdataset_shards)  -> raw record or Skip
    SampleEncoder (encode.py, uses ChatTokenizer + image transform) -> ids, labels, pixels
    PadCollator / PackingCollator (collate.py)                 -> batch dict
    MixtureDataset + MixtureLoader (mixture.py)                -> weighted, resumable batches

`build_loader(data_cfg, chat_tokenizer, image_transform, batch_size, rank, world_size,
num_workers, seed)` wires it all from a config such as configs/data/default.yaml.
"""

import importlib

# name -> submodule; imported lazily so `python -m data_pipelines.default_data` stays light
_EXPORTS = {
    "CHAT_TEMPLATE": "chat_template", "ChatTokenizer": "chat_template",
    "TokenizationMismatch": "chat_template", "PackingCollator": "collate",
    "PadCollator": "collate", "truncate_sample": "collate", "IGNORE_INDEX": "common",
    "SPECIAL_TOKENS": "common", "Skip": "common", "SampleEncoder": "encode",
    "ImageTransform": "images", "load_image": "images", "to_rgb": "images",
    "LlavaJsonDataset": "llava_json", "MixtureDataset": "mixture", "MixtureLoader": "mixture",
    "TooMuchBadData": "mixture", "build_loader": "mixture", "TextCorpusDataset": "text_corpus",
    "WebDatasetShards": "webdataset_shards",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
