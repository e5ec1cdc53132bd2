"""A data config's `datasets` entries -> reader objects (`build_sources`), and reading the config
itself (`load_data_config`); `mixture.build_loader` puts them together. Keys: data_pipelines/README.md.
"""

from __future__ import annotations

import os

import yaml

from vlm.modeling.chat_common import DATASET_TYPES
from vlm.modeling.image_transform import DEFAULT_MAX_PIXELS
from .llava_json import LlavaJsonDataset
from .stream_source import WebDatasetSource
from .text_corpus import TextCorpusDataset


def load_data_config(data_cfg) -> dict:
    """A dict, a YAML path, or a training config with a `data:` section -> the data dict."""
    if isinstance(data_cfg, (str, os.PathLike)):
        with open(data_cfg, encoding="utf-8") as f:
            data_cfg = yaml.safe_load(f)
    cfg = dict(data_cfg)
    if "datasets" not in cfg and isinstance(cfg.get("data"), dict):
        cfg = dict(cfg["data"])
    if not cfg.get("datasets"):
        raise ValueError("data config needs a non-empty `datasets` list")
    return cfg


def build_sources(cfg: dict, chat_tokenizer, max_length: int):
    """Instantiate the readers named in cfg['datasets'] -> (datasets, weights, names)."""
    root = cfg.get("root")
    resolve = lambda p: p if root is None or os.path.isabs(p) else os.path.join(root, p)
    datasets, weights, names = [], [], []
    for entry in cfg["datasets"]:
        kind, name = entry.get("type"), entry.get("name")
        if kind == "llava_json":
            image_root = entry.get("image_root")
            ds = LlavaJsonDataset(resolve(entry["path"]),
                                  image_root=resolve(image_root) if image_root else None,
                                  max_image_pixels=entry.get("max_image_pixels", DEFAULT_MAX_PIXELS),
                                  name=name, index_cache_dir=cfg.get("index_cache_dir"),
                                  collective_index=True)
        elif kind == "webdataset":
            ds = WebDatasetSource(resolve(entry["path"]), name=name, caption_prompt=entry.get("caption_prompt"),
                                  max_image_pixels=entry.get("max_image_pixels", DEFAULT_MAX_PIXELS))
        elif kind == "text":
            ds = TextCorpusDataset(resolve(entry["path"]), tokenizer=chat_tokenizer.tokenizer,
                                   max_tokens=max_length - 1 - len(chat_tokenizer.bos), name=name)
        else:
            raise ValueError(f"dataset type {kind!r} not supported in a mixture (use one of {DATASET_TYPES})")
        datasets.append(ds)
        weights.append(float(entry.get("weight", 1.0)))
        names.append(name or ds.name)
    return datasets, weights, names
