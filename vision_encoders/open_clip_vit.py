"""The vision tower of any open_clip ViT model as a patch-feature encoder.

The full CLIP model is built with ``open_clip.create_model(name, pretrained=path)``
(a local, full open_clip checkpoint: image and text towers, loaded strictly by
open_clip's own loader), then only ``.visual`` is kept. Features come from
``VisionTransformer.forward_intermediates``: "last" is the final block after
``ln_post`` (the tokens open_clip returns with ``output_tokens=True``),
"penultimate" the raw output of the second-to-last block. open_clip ViTs have
exactly one prefix token, the CLS token.
"""

from __future__ import annotations

import open_clip
import torch
from open_clip.transformer import VisionTransformer

from vision_encoders.base import VisionEncoder, VisionEncoderConfig, resolve_model_name, resolve_weights


class OpenClipViTEncoder(VisionEncoder):
    def __init__(
        self,
        cfg: VisionEncoderConfig,
        *,
        model_name: str | None = None,
        model_kwargs: dict | None = None,
        requires_weights: bool = False,
    ) -> None:
        name = resolve_model_name(cfg, model_name)
        if name not in open_clip.list_models():
            raise ValueError(f"vision.model_name {name!r} is not an open_clip model config")
        weights = resolve_weights(cfg, required=requires_weights)
        kwargs = {**(model_kwargs or {}), **cfg.model_kwargs}
        clip = open_clip.create_model(
            name,
            pretrained=None if weights is None else str(weights),
            force_image_size=cfg.image_size,
            weights_only=True,
            **kwargs,
        )
        visual = clip.visual
        if not isinstance(visual, VisionTransformer):
            raise ValueError(f"vision.model_name {name!r} has no open_clip ViT tower (got {type(visual).__name__})")
        num_blocks = len(visual.transformer.resblocks)
        if cfg.feature_layer == "penultimate" and num_blocks < 2:
            raise ValueError(f"vision.feature_layer='penultimate' needs at least 2 blocks, {name!r} has {num_blocks}")
        image_h, image_w = visual.image_size
        if image_h != image_w:
            raise ValueError(f"vision: only square inputs are supported, {name!r} takes {image_h}x{image_w}")

        preprocess_cfg = visual.preprocess_cfg
        super().__init__(
            cfg,
            image_size=image_h,
            patch_grid=visual.grid_size,
            embed_dim=visual.transformer.width,
            has_cls_token=True,
            image_mean=preprocess_cfg["mean"],
            image_std=preprocess_cfg["std"],
            interpolation=preprocess_cfg["interpolation"],
        )
        self.visual = visual
        self._layer_index = num_blocks - 1 if cfg.feature_layer == "last" else num_blocks - 2

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
