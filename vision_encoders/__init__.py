"""Vision encoders (timm / open_clip / transformers ViTs; weights from local files or the local HF
cache, one log line per load), their image transform, and the projector: the public names of the towers that
live in the model package (``vlm/modeling/vision_*.py``, ``projector.py``), which an export carries.

    encoder = build_vision_encoder(VisionEncoderConfig(backbone="tiny-vit"))  # pixels [B,3,H,W] -> [B,P,D]
    transform = encoder.image_transform()                                      # PIL image -> [3,H,W]
    projector = build_projector(ProjectorConfig(), encoder.embed_dim, lm_dim, encoder.patch_grid)
    tokens_BQd = projector(encoder(torch.stack([transform(im) for im in images])))
"""

from vlm.modeling.vision_base import VisionEncoder, VisionEncoderConfig
from vlm.modeling.projector import Projector, ProjectorConfig, build_projector
from vlm.modeling.vision_registry import VISION_BACKBONES, build_vision_encoder, register_vision_backbone

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
