"""Vision encoder contract: config, abstract module and the local-weights policy.

A vision encoder maps ``pixel_values_BCHW`` (already preprocessed by its own
``transform``) to patch features ``features_BPD``. Patches come in raster
(row-major) order over ``patch_grid``; with ``keep_cls`` the CLS token is put in
front, so ``P = grid_h * grid_w + keep_cls``. Register/distillation tokens are
always dropped.

Weights only ever come from a local file (``VisionEncoderConfig.pretrained``);
nothing here downloads from a hub. ``pretrained=None`` is an explicit random init.
Files other than ``.safetensors`` are torch pickles and are refused unless
``trust_pickle=True`` (they are then read with ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
from PIL import Image
from torch import nn
from torchvision import transforms as T

FEATURE_LAYERS = ("last", "penultimate")
SAFE_WEIGHT_SUFFIX = ".safetensors"
HUB_PREFIXES = ("hf-hub:", "hf_hub:")


@dataclass
class VisionEncoderConfig:
    """Which vision backbone to build and how to read its features.

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

    backbone: str
    model_name: str | None = None
    pretrained: str | None = None
    trust_pickle: bool = False
    feature_layer: str = "last"
    keep_cls: bool = False
    image_size: int | None = None
    model_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.backbone, str) or not self.backbone:
            raise ValueError(f"vision.backbone must be a non-empty string, got {self.backbone!r}")
        if self.model_name is not None and (not isinstance(self.model_name, str) or not self.model_name):
            raise ValueError(f"vision.model_name must be a non-empty string or None, got {self.model_name!r}")
        if self.pretrained is not None:
            if not isinstance(self.pretrained, (str, os.PathLike)) or not os.fspath(self.pretrained):
                raise ValueError(f"vision.pretrained must be a file path or None, got {self.pretrained!r}")
            self.pretrained = os.fspath(self.pretrained)
        for name in ("trust_pickle", "keep_cls"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"vision.{name} must be a bool, got {getattr(self, name)!r}")
        if self.feature_layer not in FEATURE_LAYERS:
            raise ValueError(f"vision.feature_layer must be 'last' or 'penultimate', got {self.feature_layer!r}")
        if self.image_size is not None and (
            isinstance(self.image_size, bool) or not isinstance(self.image_size, int) or self.image_size <= 0
        ):
            raise ValueError(f"vision.image_size must be a positive int or None, got {self.image_size!r}")
        if not isinstance(self.model_kwargs, dict):
            raise ValueError(f"vision.model_kwargs must be a dict, got {self.model_kwargs!r}")


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


def _to_rgb(image: Image.Image) -> Image.Image:
    return image.convert("RGB")


class VisionEncoder(nn.Module, abc.ABC):
    """Base class: holds the geometry and preprocessing; backends implement ``forward_tokens``."""

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
        self._image_mean = tuple(image_mean)
        self._image_std = tuple(image_std)
        self._interpolation = interpolation

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

    @cached_property
    def transform(self) -> T.Compose:
        """PIL image -> FloatTensor[3, image_size, image_size], normalized for this backbone."""
        size = self._image_size
        return T.Compose([
            T.Lambda(_to_rgb),
            T.Resize((size, size), interpolation=T.InterpolationMode(self._interpolation)),
            T.ToTensor(),
            T.Normalize(self._image_mean, self._image_std),
        ])

    def preprocess(self, images: list[Image.Image]) -> torch.Tensor:
        """A list of PIL images -> FloatTensor[N, 3, image_size, image_size]."""
        return torch.stack([self.transform(image) for image in images])

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
