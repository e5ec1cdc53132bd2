"""The vision tower of an open_clip ViT as a patch-feature encoder: random, a local full-CLIP file,
a pretrained tag or an ``hf-hub:`` repo, tags and repos resolved by open_clip from the local HF cache."""

from __future__ import annotations

import os

import torch

from .vision_base import META_SOURCE, VisionEncoder, VisionEncoderConfig, check_tower, on_meta_device
from .vision_base import random_init, resolve_model_name, resolve_weights
from .vision_hub import check_pickle, hub_id, library_errors, looks_like_path, require_cached, unknown_name
from .config_base import fail


def _open_clip():
    """open_clip, imported when an open_clip tower is built: optional (an export whose tower is not
    open_clip's loads without it; transformers' check_imports skips ``try``), and never on ``import vlm``
    (it imports timm, whose utils import wandb)."""
    try:
        import open_clip
        import open_clip.constants
        import open_clip.pretrained
        import open_clip.transformer
    except ImportError as err:
        raise fail("vision.backbone", f"an open_clip tower needs open_clip, which is not importable: {err}") from err
    return open_clip


def _hub_weight_files() -> tuple[str, str]:
    constants = _open_clip().constants
    return constants.HF_SAFE_WEIGHTS_NAME, constants.HF_WEIGHTS_NAME


def _tag_cfg(name: str, tag: str) -> dict:
    """open_clip's own entry for ``tag`` (its tag -> hub repo table), or a one-line error."""
    tag_cfg = _open_clip().pretrained.get_pretrained_cfg(name, tag)
    if not tag_cfg:
        tags = ", ".join(_open_clip().pretrained.list_pretrained_tags_by_model(name)) or "none"
        raise fail("vision.pretrained", f"{tag!r} is neither a local file nor an open_clip pretrained tag of "
                                        f"{name!r} (tags: {tags})")
    if not tag_cfg.get("hf_hub"):
        raise fail("vision.pretrained", f"open_clip {name!r} tag {tag!r} has no hub repo (only "
                                        f"{tag_cfg.get('url') or 'nothing'}); download it and give the file")
    return tag_cfg


def _tag_files(tag_cfg: dict) -> tuple[str, tuple[str, ...]]:
    """(hub repo, candidate files) as open_clip resolves them: "org/name/" or "org/name/file"."""
    repo, filename = os.path.split(tag_cfg["hf_hub"])
    constants = _open_clip().constants
    filename = filename or constants.HF_WEIGHTS_NAME  # tried after its safetensors alternative, as open_clip does
    safe = constants.HF_SAFE_WEIGHTS_NAME if filename == constants.HF_WEIGHTS_NAME else os.path.splitext(filename)[0] + ".safetensors"
    return repo, (safe, filename) if filename.endswith((".bin", ".pth")) else (filename,)


def _weights(cfg: VisionEncoderConfig, name: str, requires_weights: bool) -> tuple[str, dict]:
    """(log source, create_model kwargs that load it)."""
    repo = hub_id(name)
    if repo is not None:
        if cfg.pretrained is not None:
            raise fail("vision.pretrained", f"must be null with model_name {name!r} (the hub repo holds the weights)")
        require_cached("vision.model_name", f"open_clip {name!r}", repo, (_open_clip().constants.HF_CONFIG_NAME,))
        if on_meta_device():
            return META_SOURCE, {"load_weights": False}
        path = require_cached("vision.model_name", f"open_clip {name!r}", repo, _hub_weight_files())
        check_pickle("vision.model_name", path, cfg.trust_pickle)
        return f"HF cache {path}", {"require_pretrained": True}
    open_clip = _open_clip()
    if name not in open_clip.list_models():
        raise unknown_name("vision.model_name", name, "open_clip", open_clip.list_models())
    if cfg.pretrained is None:
        return (META_SOURCE if on_meta_device() else random_init(cfg, name, requires_weights)), {}
    if looks_like_path(cfg.pretrained):
        if on_meta_device():
            return META_SOURCE, {}
        weights = resolve_weights(cfg)
        return f"file {weights}", {"pretrained": str(weights), "require_pretrained": True}
    tag = cfg.pretrained
    tag_cfg = _tag_cfg(name, tag)
    # the tag's preprocessing, and QuickGELU where the tag was trained with it (open_clip itself only warns)
    tag_kwargs = {"force_quick_gelu": bool(tag_cfg.get("quick_gelu")),
                  "force_preprocess_cfg": {k: tag_cfg[k] for k in ("mean", "std", "interpolation") if k in tag_cfg}}
    if on_meta_device():
        return META_SOURCE, tag_kwargs
    repo, files = _tag_files(tag_cfg)
    path = require_cached("vision.pretrained", f"open_clip {name!r} tag {tag!r}", repo, files)
    check_pickle("vision.pretrained", path, cfg.trust_pickle)
    return f"HF cache {path}", {**tag_kwargs, "pretrained": tag, "require_pretrained": True}


class OpenClipViTEncoder(VisionEncoder):
    """``.visual`` of ``open_clip.create_model(name, pretrained=...)`` (a full CLIP, loaded strictly).

    Preprocessing (mean / std / interpolation) is open_clip's for the model and tag. Features
    come from ``forward_intermediates``: "last" is the final block after ``ln_post`` (the tokens of
    ``output_tokens=True``), "penultimate" the raw second-to-last block. The one prefix token is CLS.
    Configs with a timm vision tower (SigLIP) are refused: use backbone timm or hf for those.
    """

    def __init__(
        self,
        cfg: VisionEncoderConfig,
        *,
        model_name: str | None = None,
        model_kwargs: dict | None = None,
        requires_weights: bool = False,
    ) -> None:
        open_clip = _open_clip()
        name = resolve_model_name(cfg, model_name)
        kwargs = {**(model_kwargs or {}), **cfg.model_kwargs}
        source, load_kwargs = _weights(cfg, name, requires_weights)
        if on_meta_device():
            load_kwargs["device"] = "meta"  # open_clip moves the model to its device (cpu) otherwise
        with library_errors("vision.model_name", f"open_clip {name!r}"):
            clip = open_clip.create_model(name, force_image_size=cfg.image_size, weights_only=True,
                                          pretrained_text=False, **load_kwargs, **kwargs)
        visual = clip.visual
        if not isinstance(visual, open_clip.transformer.VisionTransformer):
            raise fail("vision.model_name", f"{name!r} has no open_clip ViT tower (got {type(visual).__name__})")
        num_blocks = len(visual.transformer.resblocks)
        image_size = check_tower(cfg, name, num_blocks, visual.image_size)

        preprocess_cfg = visual.preprocess_cfg
        super().__init__(
            cfg,
            image_size=image_size,
            patch_grid=visual.grid_size,
            embed_dim=visual.transformer.width,
            has_cls_token=True,
            image_mean=preprocess_cfg["mean"],
            image_std=preprocess_cfg["std"],
            interpolation=preprocess_cfg["interpolation"],
        )
        self.visual = visual
        self._layer_index = num_blocks - 1 if cfg.feature_layer == "last" else num_blocks - 2
        self.log_weights(f"open_clip {name!r}", source)

    def forward_tokens(self, pixel_values_BCHW: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        out = self.visual.forward_intermediates(
            pixel_values_BCHW,
            indices=[self._layer_index],
            stop_early=True,
            normalize_intermediates=self.cfg.feature_layer == "last",
            intermediates_only=True,
            output_fmt="NLC",
            output_extra_tokens=True,
        )
        cls_BD = out["image_intermediates_prefix"][0][:, 0]
        return cls_BD, out["image_intermediates"][0]
