"""Registry of vision backbones: id -> (encoder class, constructor kwargs); ``build_vision_encoder``.

Preset kwargs: ``model_name`` (``cfg.model_name`` overrides it), ``model_kwargs`` (``cfg.model_kwargs``
overrides them key by key) and ``requires_weights`` (big pretrained presets refuse a random init).
Build errors are one-line ``ConfigError``s (a ``ValueError``; the trainer exits 2 on them).
"""

from __future__ import annotations

from .vision_base import VisionEncoder, VisionEncoderConfig
from .vision_hf import HFViTEncoder
from .vision_open_clip import OpenClipViTEncoder
from .vision_timm import TimmViTEncoder
from .config_base import fail

VISION_BACKBONES: dict[str, tuple[type[VisionEncoder], dict]] = {}


def register_vision_backbone(backbone_id: str, cls: type[VisionEncoder], **kwargs) -> None:
    """Register ``backbone_id`` -> ``cls(cfg, **kwargs)``; ids are unique."""
    if backbone_id in VISION_BACKBONES:
        raise ValueError(f"vision backbone {backbone_id!r} is already registered")
    VISION_BACKBONES[backbone_id] = (cls, kwargs)


def build_vision_encoder(cfg: VisionEncoderConfig) -> VisionEncoder:
    if cfg.backbone not in VISION_BACKBONES:
        known = ", ".join(sorted(VISION_BACKBONES))
        raise fail("vision.backbone", f"{cfg.backbone!r} is unknown; known ids: {known}")
    cls, kwargs = VISION_BACKBONES[cfg.backbone]
    return cls(cfg, **kwargs)


# Small random-init ViTs for CPU tests (8x8 digit images upscaled; grayscale converted to RGB).
register_vision_backbone(
    "tiny-vit",  # 16x16 input, 4x4 patches -> 16 patches of dim 64
    TimmViTEncoder,
    model_name="vit_tiny_patch16_224",
    model_kwargs={"img_size": 16, "patch_size": 4, "embed_dim": 64, "depth": 2, "num_heads": 4},
)
register_vision_backbone(
    "small-vit",  # 32x32 input, 4x4 patches -> 64 patches of dim 128
    TimmViTEncoder,
    model_name="vit_tiny_patch16_224",
    model_kwargs={"img_size": 32, "patch_size": 4, "embed_dim": 128, "depth": 4, "num_heads": 4},
)

# Generic backends: vision.model_name is required.
register_vision_backbone("timm", TimmViTEncoder)
register_vision_backbone("open_clip", OpenClipViTEncoder)
register_vision_backbone("hf", HFViTEncoder)

# Pretrained presets: never random (a tagged name loads the tag from the local HF cache).
register_vision_backbone(
    "siglip-so400m",  # timm, 384px, 27x27 patches of dim 1152, no CLS token; or a local timm state dict
    TimmViTEncoder,
    model_name="vit_so400m_patch14_siglip_384.webli",
    requires_weights=True,
)
register_vision_backbone(
    "clip-vit-l-336",  # OpenAI CLIP ViT-L/14@336 (QuickGELU), 24x24 patches of dim 1024: pretrained openai or a
    # local full open_clip checkpoint
    OpenClipViTEncoder,
    model_name="ViT-L-14-336-quickgelu",
    requires_weights=True,
)
