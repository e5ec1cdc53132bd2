"""Any timm Vision Transformer as a patch-feature encoder (local weights through timm's own loader)."""

from __future__ import annotations

import timm
import torch

from vision_encoders.base import VisionEncoder, VisionEncoderConfig, check_tower, resolve_backbone


class TimmViTEncoder(VisionEncoder):
    """``timm.create_model(name, num_classes=0, **kwargs)``.

    Local weights go through timm's loader (``pretrained_cfg_overlay=dict(file=...)``), so its
    checkpoint filters apply (classifier removal, position-embedding resampling for a new ``img_size``).
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
        name, weights, kwargs = resolve_backbone(cfg, model_name, model_kwargs, requires_weights)
        if cfg.image_size is not None:
            kwargs["img_size"] = cfg.image_size
        if weights is not None:
            # custom_load=False: our file is always a state dict, never timm's legacy .npz format.
            kwargs.update(pretrained=True, pretrained_cfg_overlay={"file": str(weights), "custom_load": False})
        model = timm.create_model(name, num_classes=0, **kwargs)
        if not all(hasattr(model, attr) for attr in ("patch_embed", "blocks", "forward_intermediates")):
            raise ValueError(f"vision.model_name {name!r} is not a timm Vision Transformer")
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
