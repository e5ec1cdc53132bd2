"""Data loaders for the trainer: the real mixture (``data_pipelines.mixture``) or a synthetic,
deterministic and resumable one. The model side is in ``build.py``."""
from __future__ import annotations

from pathlib import Path

from vlm.modeling.config_base import ConfigError
from vlm.config.train import DATA_LOADER_KEYS, TrainConfig

IGNORE_INDEX = -100


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


def check_data_paths(cfg: TrainConfig) -> None:
    """Before anything is built: every file the run will read exists (``data.datasets[i].path`` /
    ``.image_root`` of a mixture, ``eval.vqa_json`` / ``eval.image_root`` of a VLM), else one
    ``ConfigError`` naming the key and the path as the loader would open it; and some dataset with a
    weight above 0 is not an empty file (the mixture's own check, made before the model is built)."""
    import os

    drawn, empty, where = 0, [], ""  # mixture datasets that may give records; the empty files among them
    if cfg.data.kind == "mixture":
        data = data_config(cfg)
        root = data.get("root")
        where = f" (in data.config {cfg.data.config})" if cfg.data.datasets is None and cfg.data.config else ""
        resolve = lambda p: p if root is None or os.path.isabs(p) else os.path.join(root, p)  # as build_sources
        for i, entry in enumerate(data.get("datasets") or []):
            if not isinstance(entry, dict) or not entry.get("path"):
                continue  # the config check and build_sources name these
            key, path = f"data.datasets[{i}]", resolve(str(entry["path"]))
            if entry.get("type") == "webdataset":
                missing = _missing_shard(path)
                if missing is not None:
                    raise ConfigError(f"config error: {key}.path{where}: {missing}")
            elif entry.get("type") in ("llava_json", "text") and not os.path.isfile(path):
                raise ConfigError(f"config error: {key}.path{where}: file not found: {path}")
            image_root = entry.get("image_root")
            if entry.get("type") == "llava_json" and image_root and not os.path.isdir(resolve(str(image_root))):
                raise ConfigError(f"config error: {key}.image_root{where}: folder not found: {resolve(str(image_root))}")
            if _weight(entry) > 0:
                drawn += 1
                kind = entry.get("type")
                if kind in ("llava_json", "text") and _is_empty_file(path, json_list=kind == "llava_json"):
                    empty.append(f"{key}.path {path}")
    e = cfg.eval
    if cfg.model.kind == "vlm" and e.vqa_json:
        if not os.path.isfile(e.vqa_json):
            raise ConfigError(f"config error: eval.vqa_json: file not found: {e.vqa_json}")
        if e.image_root and not os.path.isdir(e.image_root):
            raise ConfigError(f"config error: eval.image_root: folder not found: {e.image_root}")
    if drawn and len(empty) == drawn:  # every path is there, but no record
        raise ConfigError(f"config error: data{where}: no records to draw from: every dataset with a weight "
                          f"above 0 is an empty file ({', '.join(empty)})")


def _weight(entry: dict) -> float:
    try:
        return float(entry.get("weight", 1.0))
    except (TypeError, ValueError):
        return 1.0  # not a number: the mixture's config check names it


def _is_empty_file(path: str, json_list: bool, probe: int = 4096) -> bool:
    """No record can be in it: nothing but whitespace, or (``json_list``) an empty JSON list; only a
    small file is read."""
    import os

    size = os.path.getsize(path)
    if size > probe:
        return False
    with open(path, "rb") as f:
        text = f.read().strip()
    return b"".join(text.split()) in ((b"", b"[]") if json_list else (b"",))


def _missing_shard(path: str) -> str | None:
    """Why the shards of ``path`` (a folder, glob or brace pattern) cannot be read, or None."""
    import os

    from data_pipelines.webdataset_shards import list_shards

    shards = list_shards(path)
    if not shards:
        return f"no shards found: {path}"
    local = [s for s in shards if "://" not in s and not s.startswith("pipe:")]
    gone = next((s for s in local if not os.path.isfile(s)), None)
    return f"shard not found: {gone}" if gone else None


def build_loader(cfg: TrainConfig, model, model_config, tokenizer, processor, rank: int, world_size: int):
    """``data.kind: mixture``: ``data_pipelines.mixture.build_loader`` with the data YAML
    (``data.config``) updated by the non-null loader keys of the ``data`` section; ``synthetic``:
    ``SyntheticLoader`` (no files; deterministic, resumable)."""
    if cfg.data.kind == "synthetic":
        tc = getattr(model_config, "text_config", model_config)
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
    from vlm.modeling.chat_template import ChatTokenizer
    from data_pipelines.mixture import build_loader as build_mixture

    if processor is not None:
        chat, transform = processor.chat_tokenizer, processor.image_transform
    else:
        chat, transform = ChatTokenizer(tokenizer, num_image_tokens=0), None
    try:
        return build_mixture(data_config(cfg), chat, transform, cfg.train.micro_batch_size, rank=rank,
                             world_size=world_size, num_workers=cfg.data.num_workers, seed=cfg.seed)
    except (ConfigError, FileNotFoundError):
        raise
    except (ValueError, OSError) as err:  # the data's fault (invalid JSON list, too few shards, ...): one line
        raise ConfigError(f"config error: data: {err}") from None


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
        import torch  # here, not at the top: the data paths are checked before torch loads (vlm/train.py)

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
