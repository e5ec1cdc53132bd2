"""Vision encoder contract: config, abstract module, its image preprocessing and the weights policy.

An encoder maps ``pixel_values_BCHW`` (made by ``encoder.image_transform()``) to patch features
``features_BPD`` in raster order over ``patch_grid``, the CLS token in front if ``keep_cls``.
Weights come from local files or the local Hugging Face cache only (``vlm.modeling.vision_hub``); every
load logs one line, and a random init happens only when nothing names weights.
"""

from __future__ import annotations

import abc
import logging
import os
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import AfterValidator, BeforeValidator, Field
from torch import nn

from .image_transform import ANYRES_GRIDS, IMAGE_ASPECTS, RESAMPLE_MODES, ImageTransform, check_grids
from .vision_hub import HUB_PREFIXES, HUB_REPO_RE, check_pickle, hub_id, log_load
from .config_base import PosInt, Section, Text, fail

FEATURE_LAYERS = ("last", "penultimate")
__all__ = ["FEATURE_LAYERS", "HUB_PREFIXES", "IMAGE_ASPECTS", "VisionEncoder", "VisionEncoderConfig"]


def _fspath(value):
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _hub_form(value: str) -> str:
    repo = hub_id(value)
    if repo is not None and not HUB_REPO_RE.fullmatch(repo):
        raise ValueError(f"a hub reference must be hf-hub:<org>/<name>, got {value!r}")
    return value


def _grids(value: list[list[int]]) -> list[list[int]]:
    check_grids(value)  # repeats (shape and positivity are the field type's)
    return value


Grid = Annotated[list[PosInt], Field(min_length=2, max_length=2)]


class VisionEncoderConfig(Section):
    """Which vision backbone to build and how to read its features (the VLM config's ``vision:``).

    backbone:      registry id (see ``VISION_BACKBONES``): a preset ("tiny-vit"), "timm", "open_clip", "hf".
    model_name:    the library model: a timm name, tagged names load the tag's weights
                   ("vit_so400m_patch14_siglip_384.webli"); an open_clip config name ("ViT-B-16");
                   "hf-hub:org/name" (timm / open_clip repos, weights included); for "hf" a folder or hub id.
    pretrained:    a local weights file, or for open_clip a pretrained tag ("laion2b_s34b_b88k"). Null
                   with a model name that names no weights is the only random init.
    trust_pickle:  allow a non-safetensors (pickle) weights file.
    feature_layer: "last" (final block after the final norm) or "penultimate"
                   (raw output of the second-to-last block).
    keep_cls:      put the CLS token in front of the patch tokens.
    image_size:    overrides the preset's input resolution (square).
    image_aspect:  "resize" squashes the image to the square; "pad" pads it to a square with the
                   mean colour first (LLaVA-1.5); "anyres" gives the padded image (a thumbnail) plus
                   the tiles of the best of ``anyres_grids`` (LLaVA-NeXT): 1 + cols*rows views.
    anyres_grids:  [cols, rows] grids in units of the tower's square input, tried in order (LLaVA-NeXT's
                   select_best_resolution); read only with image_aspect "anyres".
    model_kwargs:  extra kwargs for the library constructor (override the preset's).
    """

    backbone: Text
    model_name: Annotated[Text, AfterValidator(_hub_form)] | None = None
    pretrained: Annotated[Text, BeforeValidator(_fspath)] | None = None
    trust_pickle: bool = False
    feature_layer: Literal[FEATURE_LAYERS] = "last"
    keep_cls: bool = False
    image_size: PosInt | None = None
    image_aspect: Literal[IMAGE_ASPECTS] = "resize"
    anyres_grids: Annotated[list[Grid], Field(min_length=1), AfterValidator(_grids)] = Field(
        default_factory=lambda: [list(grid) for grid in ANYRES_GRIDS])
    model_kwargs: dict = {}


def resolve_model_name(cfg: VisionEncoderConfig, preset_name: str | None) -> str:
    """The library model name: ``cfg.model_name`` if set, else the preset's (``hf_hub:`` -> ``hf-hub:``)."""
    name = cfg.model_name or preset_name
    if name is None:
        raise fail("vision.model_name", f"is required for backbone {cfg.backbone!r}")
    repo = hub_id(name)
    return name if repo is None else HUB_PREFIXES[0] + repo


def resolve_weights(cfg: VisionEncoderConfig) -> Path:
    """``cfg.pretrained`` as a local weights file (safetensors unless ``trust_pickle``)."""
    path = Path(cfg.pretrained).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"vision.pretrained: weights file not found: {path}")
    check_pickle("vision.pretrained", str(path), cfg.trust_pickle)
    return path


META_SOURCE = "the checkpoint being loaded (built on the meta device, nothing read here)"


def on_meta_device() -> bool:
    """Built inside a ``from_pretrained`` (meta device): only the architecture is needed."""
    return torch.empty(0).is_meta


def random_init(cfg: VisionEncoderConfig, name: str, requires_weights: bool) -> str:
    """The log source of a random init, refused for presets that need weights."""
    if requires_weights:
        raise fail("vision.pretrained", f"is required for backbone {cfg.backbone!r} ({name!r} would be random)")
    return "random init (vision.pretrained: null)"


def check_tower(cfg: VisionEncoderConfig, name: str, num_blocks: int, image_hw) -> int:
    """Shared checks on a built tower (enough blocks for ``feature_layer``, square input); the image size."""
    if cfg.feature_layer == "penultimate" and num_blocks < 2:
        raise fail("vision.feature_layer", f"'penultimate' needs at least 2 blocks, {name!r} has {num_blocks}")
    image_h, image_w = image_hw
    if image_h != image_w:
        raise fail("vision.image_size", f"only square inputs are supported, {name!r} takes {image_h}x{image_w}")
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
            raise fail("vision.keep_cls", f"true but backbone {cfg.backbone!r} has no CLS token")
        self.cfg = cfg
        self._image_size = image_size
        self._patch_grid = tuple(patch_grid)
        self._embed_dim = embed_dim
        self._transform_settings = {
            "image_size": image_size,
            "image_mean": [float(v) for v in image_mean],
            "image_std": [float(v) for v in image_std],
            "resample": interpolation if interpolation in RESAMPLE_MODES else "bicubic",
            "image_aspect": cfg.image_aspect,
        }
        if cfg.image_aspect == "anyres":
            self._transform_settings["anyres_grids"] = [list(grid) for grid in cfg.anyres_grids]

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

    def log_weights(self, what: str, source: str) -> str:
        """Log the one load line (call at the end of the backend's ``__init__``); returns it.
        ``load_what`` keeps ``what`` for a later load into this tower to log its own line."""
        self.load_what = what
        # a tower built inside from_pretrained (META_SOURCE) holds nothing yet: the weights that load into it
        # are the model's to report, so that line is debug-level (it came with every model load)
        level = logging.DEBUG if source == META_SOURCE else logging.INFO
        self.load_line = log_load(self, what, source, level)
        return self.load_line

    def image_transform(self) -> ImageTransform:
        """The preprocessing this backbone expects: PIL image -> ``views`` Float[k, 3, image_size, image_size].

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
