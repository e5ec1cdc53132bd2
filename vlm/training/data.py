"""Model, tokenizer / processor and data loaders for the trainer: the real mixture
(``data_pipelines.mixture``) or a synthetic, deterministic and resumable one."""
from __future__ import annotations

from pathlib import Path

import torch

from vlm.config import ConfigError
from vlm.config.train import DATA_LOADER_KEYS, TrainConfig

IGNORE_INDEX = -100


def _prefix_error(err: Exception) -> ConfigError:
    msg = str(err)
    if msg.startswith("config error: "):
        return ConfigError("config error: model." + msg[len("config error: "):])
    return ConfigError(f"config error: model: {msg.splitlines()[0] if msg else type(err).__name__}")


def load_tokenizer(path: str | None):
    if not path:
        return None
    if not Path(path).is_dir():
        raise ConfigError(f"config error: model.tokenizer: folder not found: {path} (run `make data`?)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


def token_ids(tokenizer) -> dict:
    """Model-config token fields from a tokenizer with our special tokens."""
    from data_pipelines.common import (
        END_TOKEN,
        IMAGE_END_TOKEN,
        IMAGE_START_TOKEN,
        IMAGE_TOKEN,
        PAD_TOKEN,
    )

    vocab = tokenizer.get_vocab()
    ids = {"vocab_size": len(tokenizer), "pad_token_id": vocab.get(PAD_TOKEN, 0),
           "eos_token_id": vocab.get(END_TOKEN, tokenizer.eos_token_id)}
    img = {"image_token_id": vocab.get(IMAGE_TOKEN), "im_start_token_id": vocab.get(IMAGE_START_TOKEN),
           "im_end_token_id": vocab.get(IMAGE_END_TOKEN)}
    return ids, img


def synthetic_token_ids(vocab_size: int) -> tuple[dict, dict]:
    return ({"pad_token_id": 0, "eos_token_id": 1},
            {"image_token_id": vocab_size - 1, "im_start_token_id": vocab_size - 2,
             "im_end_token_id": vocab_size - 3})


def build_model_config(cfg: TrainConfig, tokenizer=None):
    """The model config (VLM or LM) from the preset + model overrides + tokenizer ids. With
    ``model.tokenizer`` set, the vocabulary size and the special-token ids (pad, ``<|end|>`` as eos,
    ``<image>``, ``<im_start>``, ``<im_end>``) come from the tokenizer; without one (synthetic data)
    fixed ids at the top of the preset's vocabulary are used."""
    from vlm.config import ConceptMoEConfig
    from vlm.config.vlm import ConceptMoEVLMConfig

    over = dict(cfg.model.overrides)
    try:
        if cfg.model.kind == "vlm":
            text_ids, img_ids = token_ids(tokenizer) if tokenizer is not None else ({}, {})
            model_config = ConceptMoEVLMConfig.from_yaml(cfg.model.preset, **{**text_ids, **img_ids, **over})
            if tokenizer is None:  # ids at the top of the vocabulary the preset (+ overrides) ended with
                text_ids, img_ids = synthetic_token_ids(model_config.text_config.vocab_size)
                for target, ids in ((model_config.text_config, text_ids), (model_config, img_ids)):
                    for name, value in ids.items():
                        if name not in over:
                            setattr(target, name, value)
                    target.validate()
            return model_config
        text_ids = token_ids(tokenizer)[0] if tokenizer is not None else {}
        return ConceptMoEConfig.from_yaml(cfg.model.preset, **{**text_ids, **over})
    except ConfigError as err:
        raise _prefix_error(err) from None
    except (TypeError, ValueError) as err:
        raise _prefix_error(err) from None


def build_model(model_config, kind: str):
    if kind == "vlm":
        from vlm.modeling.vlm_model import ConceptMoEVLMForConditionalGeneration

        return ConceptMoEVLMForConditionalGeneration(model_config)
    from vlm.modeling.hf import ConceptMoEForCausalLM

    return ConceptMoEForCausalLM(model_config)


def init_weights_from(model, path: str, kind: str) -> None:
    """Copy the weights of an HF export (``save_pretrained`` folder) into ``model`` (strict)."""
    if not Path(path).is_dir():
        raise ConfigError(f"config error: model.init_from: folder not found: {path} (run the previous stage first?)")
    if kind == "vlm":
        from vlm.modeling.vlm_model import ConceptMoEVLMForConditionalGeneration as cls
    else:
        from vlm.modeling.hf import ConceptMoEForCausalLM as cls
    src = cls.from_pretrained(path)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    missing = [m for m in missing if not m.endswith("lm_head.weight") or not model.config.tie_word_embeddings]
    if missing or unexpected:
        raise ConfigError(f"config error: model.init_from: {path} does not match the model "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]})")


def text_config_of(model_config):
    return getattr(model_config, "text_config", model_config)


def build_processor(model, tokenizer):
    """``ConceptMoEVLMProcessor`` for a VLM (image settings from its vision tower); None otherwise."""
    if tokenizer is None or not hasattr(model, "vision"):
        return None
    from vlm.processing import ConceptMoEVLMProcessor

    return ConceptMoEVLMProcessor.for_model(tokenizer, model)


def data_config(cfg: TrainConfig) -> dict:
    """The dict handed to ``data_pipelines.mixture.build_loader``."""
    import yaml

    base: dict = {}
    if cfg.data.config:
        path = Path(cfg.data.config)
        if not path.is_file():
            raise ConfigError(f"config error: data.config: file not found: {path}")
        base = yaml.safe_load(path.read_text()) or {}
        if "datasets" not in base and isinstance(base.get("data"), dict):
            base = dict(base["data"])
    for key in DATA_LOADER_KEYS:
        val = getattr(cfg.data, key)
        if val is not None:
            base[key] = val
    return base


def build_loader(cfg: TrainConfig, model, model_config, tokenizer, processor, rank: int, world_size: int):
    """``data.kind: mixture``: ``data_pipelines.mixture.build_loader`` with the data YAML
    (``data.config``) updated by the non-null loader keys of the ``data`` section; ``synthetic``:
    ``SyntheticLoader`` (no files; deterministic, resumable)."""
    if cfg.data.kind == "synthetic":
        tc = text_config_of(model_config)
        image = None
        if cfg.model.kind == "vlm":
            image = {"num_image_tokens": model.num_image_tokens, "image_size": model.vision.image_size,
                     "image_token_id": model_config.image_token_id,
                     "im_start_token_id": model_config.im_start_token_id,
                     "im_end_token_id": model_config.im_end_token_id}
        vocab = min(cfg.data.synthetic_vocab, tc.vocab_size - 3)
        return SyntheticLoader(cfg.train.micro_batch_size, cfg.data.max_length or 64, vocab, rank, world_size,
                               cfg.seed, pad_id=tc.pad_token_id or 0, image=image)
    if tokenizer is None:
        raise ConfigError("config error: model.tokenizer: data.kind 'mixture' needs a tokenizer folder")
    from data_pipelines.chat_template import ChatTokenizer
    from data_pipelines.mixture import build_loader as build_mixture

    if processor is not None:
        chat, transform = processor.chat_tokenizer, processor.image_transform
    else:
        chat, transform = ChatTokenizer(tokenizer, num_image_tokens=0), None
    return build_mixture(data_config(cfg), chat, transform, cfg.train.micro_batch_size, rank=rank,
                         world_size=world_size, num_workers=cfg.data.num_workers, seed=cfg.seed)


class SyntheticLoader:
    """Learnable synthetic batches: each row is an arithmetic progression mod ``vocab`` (offset 8
    so that ids 0..7 stay free), right-padded to ``seq_len`` with a random length in
    [3/4 seq_len, seq_len]; for a VLM every row starts with ``<im_start> <image>*P <im_end>`` and a
    random image whose mean brightness encodes the progression's stride. Batch ``i`` of rank ``r``
    is a pure function of (seed, r, i), so the state is just ``i``."""

    def __init__(self, batch_size: int, seq_len: int, vocab: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, pad_id: int = 0, image: dict | None = None):
        self.batch_size, self.seq_len, self.vocab = batch_size, seq_len, max(vocab - 8, 4)
        self.rank, self.world_size, self.seed, self.pad_id, self.image = rank, world_size, seed, pad_id, image
        self.index = 0
        self.bad_counts: dict = {}

    def state_dict(self) -> dict:
        return {"index": self.index, "seed": self.seed, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        self.index = int(state["index"])
        self.seed = int(state.get("seed", self.seed))

    def make_batch(self, index: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 10_007 + index)
        B, T = self.batch_size, self.seq_len
        n_img = (self.image["num_image_tokens"] + 2) if self.image else 0
        text_len = T - n_img
        ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.long)
        start = torch.randint(0, self.vocab, (B,), generator=g)
        stride = torch.randint(1, 4, (B,), generator=g)
        lengths = torch.randint(max(2, 3 * text_len // 4), text_len + 1, (B,), generator=g)
        for b in range(B):
            L = int(lengths[b])
            seq = 8 + (start[b] + stride[b] * torch.arange(L)) % self.vocab
            ids[b, n_img:n_img + L] = seq
            labels[b, n_img + 1:n_img + L] = seq[1:]
            mask[b, :n_img + L] = 1
            if self.image:
                ids[b, 0] = self.image["im_start_token_id"]
                ids[b, 1:n_img - 1] = self.image["image_token_id"]
                ids[b, n_img - 1] = self.image["im_end_token_id"]
        position = (mask.cumsum(1) - 1).clamp(min=0) * mask
        batch = {"input_ids": ids, "labels": labels, "attention_mask": mask, "position_ids": position,
                 "segment_ids": mask.clone(), "pixel_values": None, "skipped": {}, "num_samples": B}
        if self.image:
            S = self.image["image_size"]
            pix = torch.randn(B, 3, S, S, generator=g) * 0.5
            batch["pixel_values"] = pix + (stride.float() - 2.0).view(B, 1, 1, 1)
        return batch

    def __iter__(self):
        while True:
            batch = self.make_batch(self.index)
            self.index += 1
            yield batch
