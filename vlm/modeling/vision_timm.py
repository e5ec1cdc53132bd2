"""Any timm Vision Transformer as a patch-feature encoder: random, a local file, a tag or hf-hub: repo."""

from __future__ import annotations

import torch

from .vision_base import META_SOURCE, VisionEncoder, VisionEncoderConfig, check_tower, on_meta_device
from .vision_base import random_init, resolve_model_name, resolve_weights
from .vision_hub import check_pickle, hub_id, library_errors, looks_like_path, require_cached, unknown_name
from .config_base import fail

KEY = "vision.model_name"
HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def _timm():
    """timm, imported when a timm tower is built: optional (an export whose tower is not timm's loads
    without it; transformers' check_imports skips ``try``), and never on ``import vlm`` (timm.utils
    imports wandb and costs about a second)."""
    try:
        import timm
        import timm.models
    except ImportError as err:
        raise fail("vision.backbone", f"a timm tower needs timm, which is not importable: {err}") from err
    return timm


def _tag_weights(cfg: VisionEncoderConfig, name: str) -> str:
    """The cached weights file of a tagged timm name (``arch.tag``), or a one-line error."""
    timm = _timm()
    arch, tag = timm.models.split_model_name_tag(name)
    tags = [t.split(".", 1)[1] for t in timm.list_pretrained(arch) if t.startswith(arch + ".")]
    if tag not in tags:
        raise fail(KEY, f"{name!r}: {tag!r} is not a timm pretrained tag of {arch} (tags: {', '.join(tags) or 'none'})")
    pretrained_cfg = timm.models.get_pretrained_cfg(name)
    if not pretrained_cfg.hf_hub_id:
        raise fail(KEY, f"{name!r}: timm has no hub repo for this tag (only {pretrained_cfg.url or 'nothing'}); "
                        "download it and set vision.pretrained to the file")
    files = (pretrained_cfg.hf_hub_filename,) if pretrained_cfg.hf_hub_filename else HF_WEIGHT_FILES
    path = require_cached(KEY, f"timm {name!r}", pretrained_cfg.hf_hub_id, files)
    check_pickle(KEY, path, cfg.trust_pickle)
    return path


def _weights(cfg: VisionEncoderConfig, name: str, requires_weights: bool) -> tuple[str, dict]:
    """(log source, create_model kwargs that load it)."""
    repo = hub_id(name)
    if repo is not None:
        if cfg.pretrained is not None:
            raise fail("vision.pretrained", f"must be null with model_name {name!r} (the hub repo holds the weights)")
        require_cached(KEY, f"timm {name!r}", repo, ("config.json",))
        if on_meta_device():
            return META_SOURCE, {}
        path = require_cached(KEY, f"timm {name!r}", repo, HF_WEIGHT_FILES)
        check_pickle(KEY, path, cfg.trust_pickle)
        return f"HF cache {path}", {"pretrained": True}
    timm = _timm()
    arch, tag = timm.models.split_model_name_tag(name)
    if not timm.is_model(arch):
        raise unknown_name(KEY, name, "timm", timm.list_models())
    if on_meta_device():
        return META_SOURCE, {}
    if cfg.pretrained is not None:
        if not looks_like_path(cfg.pretrained):
            raise fail("vision.pretrained", f"{cfg.pretrained!r} is not a local file; a timm pretrained tag goes in "
                                            f"the model name ({arch}.{cfg.pretrained})")
        weights = resolve_weights(cfg)
        # custom_load=False: our file is always a state dict, never timm's legacy .npz format.
        return f"file {weights}", {"pretrained": True,
                                   "pretrained_cfg_overlay": {"file": str(weights), "custom_load": False}}
    if tag:
        return f"HF cache {_tag_weights(cfg, name)}", {"pretrained": True}
    return random_init(cfg, name, requires_weights), {}


class TimmViTEncoder(VisionEncoder):
    """``timm.create_model(name, num_classes=0, **kwargs)``, weights by timm's own loader.

    Weights: ``vision.pretrained`` (a local file, through ``pretrained_cfg_overlay`` so timm's
    checkpoint filters apply: classifier removal, position-embedding resampling for a new
    ``img_size``); else a tagged name (``arch.tag``) or ``hf-hub:org/name`` from the local HF cache
    (``pretrained=True``); else (an untagged name, no file) random init.
    "last" is ``forward_features`` (final block and norm), "penultimate" the raw second-to-last block.
    Of the prefix tokens only CLS can be kept; register tokens are dropped.
    """

    def __init__(
        self,
        cfg: VisionEncoderConfig,
        *,
        model_name: str | None = None,
        model_kwargs: dict | None = None,
        requires_weights: bool = False,
    ) -> None:
        timm = _timm()
        name = resolve_model_name(cfg, model_name)
        kwargs = {**(model_kwargs or {}), **cfg.model_kwargs}
        if cfg.image_size is not None:
            kwargs["img_size"] = cfg.image_size
        source, load_kwargs = _weights(cfg, name, requires_weights)
        with library_errors(KEY, f"timm {name!r}"):
            model = timm.create_model(name, num_classes=0, **kwargs, **load_kwargs)
        if not all(hasattr(model, attr) for attr in ("patch_embed", "blocks", "forward_intermediates")):
            raise fail(KEY, f"{name!r} is not a timm Vision Transformer")
        image_size = check_tower(cfg, name, len(model.blocks), model.patch_embed.img_size)

        data_cfg = model.pretrained_cfg
        super().__init__(
            cfg,
            image_size=image_size,
            patch_grid=model.patch_embed.grid_size,
            embed_dim=model.embed_dim,
            has_cls_token=bool(model.has_class_token),
            image_mean=data_cfg.get("mean", timm.data.IMAGENET_DEFAULT_MEAN),
            image_std=data_cfg.get("std", timm.data.IMAGENET_DEFAULT_STD),
            interpolation=data_cfg.get("interpolation", "bicubic"),
        )
        self.model = model
        self.log_weights(f"timm {name!r}", source)

    def forward_tokens(self, pixel_values_BCHW: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        # timm puts the CLS token first among the prefix tokens, register tokens after it.
        has_cls = self.model.has_class_token
        if self.cfg.feature_layer == "last":
            tokens_BTD = self.model.forward_features(pixel_values_BCHW)
            cls_BD = tokens_BTD[:, 0] if has_cls else None
            return cls_BD, tokens_BTD[:, self.model.num_prefix_tokens:]
        out = self.model.forward_intermediates(
            pixel_values_BCHW,
            indices=[len(self.model.blocks) - 2],
            return_prefix_tokens=has_cls,
            norm=False,
            stop_early=True,
            output_fmt="NLC",
            intermediates_only=True,
            output_dict=True,
        )
        cls_BD = out["image_intermediates_prefix"][0][:, 0] if has_cls else None
        return cls_BD, out["image_intermediates"][0]
