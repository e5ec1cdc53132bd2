"""The vision tower of an open_clip ViT as a patch-feature encoder (local full-CLIP checkpoints only)."""

from __future__ import annotations

import open_clip
import torch
from open_clip.transformer import VisionTransformer

from vision_encoders.base import VisionEncoder, VisionEncoderConfig, check_tower, resolve_backbone


class OpenClipViTEncoder(VisionEncoder):
    """``.visual`` of ``open_clip.create_model(name, pretrained=<local file>)``.

    The checkpoint is a full CLIP model (image and text towers) loaded strictly by open_clip. Features
    come from ``forward_intermediates``: "last" is the final block after ``ln_post`` (the tokens of
    ``output_tokens=True``), "penultimate" the raw second-to-last block. The one prefix token is CLS.
    """

    def __init__(
        self,
        cfg: VisionEncoderConfig,
        *,
        model_name: str | None = None,
        model_kwargs: dict | None = None,
        requires_weights: bool = False,
    ) -> None:
        name, weights, kwargs = resolve_backbone(cfg, model_name, model_kwargs, requires_weights)
        if name not in open_clip.list_models():
            raise ValueError(f"vision.model_name {name!r} is not an open_clip model config")
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
