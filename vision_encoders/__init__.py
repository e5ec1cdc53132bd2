"""Vision encoders (timm / open_clip ViTs, local weights only) and the vision-to-LM projector.

    cfg = VisionEncoderConfig(backbone="tiny-vit")
    encoder = build_vision_encoder(cfg)                      # pixels [B,3,H,W] -> features [B,P,D]
    projector = build_projector(ProjectorConfig(), encoder.embed_dim, lm_dim, encoder.patch_grid)
    tokens_BQd = projector(encoder(encoder.preprocess(images)))
"""

from vision_encoders.base import VisionEncoder, VisionEncoderConfig
from vision_encoders.projector import Projector, ProjectorConfig, build_projector
from vision_encoders.registry import VISION_BACKBONES, build_vision_encoder, register_vision_backbone

__all__ = [
    "VISION_BACKBONES",
    "Projector",
    "ProjectorConfig",
    "VisionEncoder",
    "VisionEncoderConfig",
    "build_projector",
    "build_vision_encoder",
    "register_vision_backbone",
]
