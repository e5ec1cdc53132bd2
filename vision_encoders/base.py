"""Vision encoder contract: config, abstract module, its image preprocessing and the weights policy.

An encoder maps ``pixel_values_BCHW`` (made by ``encoder.image_transform()``) to patch features
``features_BPD`` in raster order over ``patch_grid``, the CLS token in front if ``keep_cls``.
Weights come only from a local file (``pretrained``); non-safetensors files need ``trust_pickle``.
"""

from __future__ import annotations

import abc
import os
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import BeforeValidator
from torch import nn

from data_pipelines.images import RESAMPLE_MODES, ImageTransform
from vlm.config.core import PosInt, Section, Text

FEATURE_LAYERS = ("last", "penultimate")
SAFE_WEIGHT_SUFFIX = ".safetensors"
HUB_PREFIXES = ("hf-hub:", "hf_hub:")


def _fspath(value):
    return os.fspath(value) if isinstance(value, os.PathLike) else value


class VisionEncoderConfig(Section):
    """Which vision backbone to build and how to read its features (the VLM config's ``vision:``).

    backbone:      registry id (see ``VISION_BACKBONES``), e.g. "tiny-vit".
    model_name:    overrides the preset's timm / open_clip model name.
    pretrained:    local weights file; None means random init.
    trust_pickle:  allow a non-safetensors (pickle) weights file.
    feature_layer: "last" (final block after the final norm) or "penultimate"
                   (raw output of the second-to-last block).
    keep_cls:      put the CLS token in front of the patch tokens.
    image_size:    overrides the preset's input resolution (square).
    model_kwargs:  extra kwargs for the library constructor (override the preset's).
    """

    backbone: Text
    model_name: Text | None = None
    pretrained: Annotated[Text, BeforeValidator(_fspath)] | None = None
    trust_pickle: bool = False
    feature_layer: Literal[FEATURE_LAYERS] = "last"
    keep_cls: bool = False
    image_size: PosInt | None = None
    model_kwargs: dict = {}


def resolve_model_name(cfg: VisionEncoderConfig, preset_name: str | None) -> str:
    """The library model name: ``cfg.model_name`` if set, else the preset's."""
    name = cfg.model_name or preset_name
    if name is None:
        raise ValueError(f"vision.model_name is required for backbone {cfg.backbone!r}")
    if name.startswith(HUB_PREFIXES):
        raise ValueError(f"vision.model_name must be a library model name, not a hub reference, got {name!r}")
    return name


def resolve_weights(cfg: VisionEncoderConfig, required: bool) -> Path | None:
    """Check ``cfg.pretrained`` against the local-weights policy; None means random init."""
    if cfg.pretrained is None:
        if required:
            raise ValueError(f"vision.pretrained (a local weights file) is required for backbone {cfg.backbone!r}")
        return None
    path = Path(cfg.pretrained).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"vision.pretrained: weights file not found: {path}")
    if path.suffix != SAFE_WEIGHT_SUFFIX and not cfg.trust_pickle:
        raise ValueError(
            f"vision.pretrained: refusing to unpickle {path}; convert it to .safetensors or set vision.trust_pickle=true"
        )
    return path


def resolve_backbone(
    cfg: VisionEncoderConfig, model_name: str | None, model_kwargs: dict | None, requires_weights: bool
) -> tuple[str, Path | None, dict]:
    """Shared start of every backend: (library model name, local weights or None, constructor kwargs).

    The preset's ``model_kwargs`` are overridden key by key by ``cfg.model_kwargs``.
    """
    name = resolve_model_name(cfg, model_name)
    weights = resolve_weights(cfg, required=requires_weights)
    return name, weights, {**(model_kwargs or {}), **cfg.model_kwargs}


def check_tower(cfg: VisionEncoderConfig, name: str, num_blocks: int, image_hw) -> int:
    """Shared checks on a built tower (enough blocks for ``feature_layer``, square input); the image size."""
    if cfg.feature_layer == "penultimate" and num_blocks < 2:
        raise ValueError(f"vision.feature_layer='penultimate' needs at least 2 blocks, {name!r} has {num_blocks}")
    image_h, image_w = image_hw
    if image_h != image_w:
        raise ValueError(f"vision: only square inputs are supported, {name!r} takes {image_h}x{image_w}")
    return int(image_h)


class VisionEncoder(nn.Module, abc.ABC):
    """Base class: holds the geometry and the image transform; backends implement ``forward_tokens``.

    ``image_mean`` / ``image_std`` / ``interpolation`` are the library's preprocessing settings for
    the model; an interpolation ``ImageTransform`` lacks (e.g. lanczos) resizes bicubic.
    """

    def __init__(
        self,
        cfg: VisionEncoderConfig,
        *,
        image_size: int,
        patch_grid: tuple[int, int],
        embed_dim: int,
        has_cls_token: bool,
        image_mean: tuple[float, ...],
        image_std: tuple[float, ...],
        interpolation: str = "bicubic",
    ) -> None:
        super().__init__()
        if cfg.keep_cls and not has_cls_token:
            raise ValueError(f"vision.keep_cls=true but backbone {cfg.backbone!r} has no CLS token")
        self.cfg = cfg
        self._image_size = image_size
        self._patch_grid = tuple(patch_grid)
        self._embed_dim = embed_dim
        self._transform_settings = {
            "image_size": image_size,
            "image_mean": [float(v) for v in image_mean],
            "image_std": [float(v) for v in image_std],
            "resample": interpolation if interpolation in RESAMPLE_MODES else "bicubic",
        }

    @property
    def image_size(self) -> int:
        return self._image_size

    @property
    def patch_grid(self) -> tuple[int, int]:
        return self._patch_grid

    @property
    def num_patches(self) -> int:
        """Tokens per image in ``forward``'s output (patches, plus the CLS token if kept)."""
        grid_h, grid_w = self._patch_grid
        return grid_h * grid_w + int(self.cfg.keep_cls)

    @property
    def embed_dim(self) -> int:
        return self._embed_dim

    def image_transform(self) -> ImageTransform:
        """The preprocessing this backbone expects: PIL image -> Float[3, image_size, image_size].

        The one transform of the project: training data, evaluation and the processor all use it.
        """
        return ImageTransform(**self._transform_settings)

    @abc.abstractmethod
    def forward_tokens(self, pixel_values_BCHW: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(cls_BD or None, patches_BND)`` taken at ``cfg.feature_layer``, patches in raster order."""

    def forward(self, pixel_values_BCHW: torch.Tensor) -> torch.Tensor:
        expected_CHW = (3, self._image_size, self._image_size)
        if pixel_values_BCHW.ndim != 4 or tuple(pixel_values_BCHW.shape[1:]) != expected_CHW:
            raise ValueError(
                f"vision encoder expects pixel values [B, {', '.join(map(str, expected_CHW))}], "
                f"got {list(pixel_values_BCHW.shape)}"
            )
        cls_BD, patches_BND = self.forward_tokens(pixel_values_BCHW)
        if not self.cfg.keep_cls:
            return patches_BND
        return torch.cat([cls_BD[:, None], patches_BND], dim=1)
