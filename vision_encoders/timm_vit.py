"""Any timm Vision Transformer as a patch-feature encoder.

The model is built with ``timm.create_model(name, num_classes=0, **kwargs)``;
local weights go through timm's own loader (``pretrained_cfg_overlay=dict(file=...)``),
so timm's checkpoint filters still apply (classifier removal, position-embedding
resampling for a changed ``img_size``). "last" is what ``forward_features``
returns (final block, final norm); "penultimate" is the raw output of the
second-to-last block, from ``forward_intermediates``. Of the prefix tokens only
the CLS token can be kept; register tokens are dropped.
"""

from __future__ import annotations

import timm
import torch

from vision_encoders.base import VisionEncoder, VisionEncoderConfig, resolve_model_name, resolve_weights


class TimmViTEncoder(VisionEncoder):
    def __init__(
        self,
        cfg: VisionEncoderConfig,
        *,
        model_name: str | None = None,
        model_kwargs: dict | None = None,
        requires_weights: bool = False,
    ) -> None:
        name = resolve_model_name(cfg, model_name)
        weights = resolve_weights(cfg, required=requires_weights)
        kwargs = {**(model_kwargs or {}), **cfg.model_kwargs}
        if cfg.image_size is not None:
            kwargs["img_size"] = cfg.image_size
        if weights is not None:
            # custom_load=False: our file is always a state dict, never timm's legacy .npz format.
            kwargs.update(pretrained=True, pretrained_cfg_overlay={"file": str(weights), "custom_load": False})
        model = timm.create_model(name, num_classes=0, **kwargs)
        if not all(hasattr(model, attr) for attr in ("patch_embed", "blocks", "forward_intermediates")):
            raise ValueError(f"vision.model_name {name!r} is not a timm Vision Transformer")
        if cfg.feature_layer == "penultimate" and len(model.blocks) < 2:
            raise ValueError(f"vision.feature_layer='penultimate' needs at least 2 blocks, {name!r} has {len(model.blocks)}")
        image_h, image_w = model.patch_embed.img_size
        if image_h != image_w:
            raise ValueError(f"vision: only square inputs are supported, {name!r} takes {image_h}x{image_w}")

        data_cfg = model.pretrained_cfg
        super().__init__(
            cfg,
            image_size=image_h,
            patch_grid=model.patch_embed.grid_size,
            embed_dim=model.embed_dim,
            has_cls_token=bool(model.has_class_token),
            image_mean=data_cfg.get("mean", timm.data.IMAGENET_DEFAULT_MEAN),
            image_std=data_cfg.get("std", timm.data.IMAGENET_DEFAULT_STD),
            interpolation=data_cfg.get("interpolation", "bicubic"),
        )
        self.model = model

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
