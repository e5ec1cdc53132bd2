"""Vision encoders: shapes, the backbone's image transform (resize / pad), feature equality with timm /
open_clip from local files, the one-line load log and build errors (hub-cache loads: test_vision_hub.py).

Every weight file is written by the test into tmp_path; nothing is downloaded.
"""

import json
import logging
import re

import numpy as np
import open_clip
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file
from sklearn.datasets import load_digits
from torchvision import transforms

from vlm.modeling.image_transform import ImageTransform, to_rgb
from vlm.modeling.vision_registry import VISION_BACKBONES, build_vision_encoder, register_vision_backbone
from vlm.modeling.vision_base import VisionEncoderConfig
from vlm.modeling.vision_hub import weights_digest
from vlm.modeling.vision_open_clip import OpenClipViTEncoder
from vlm.modeling.vision_timm import TimmViTEncoder
from vlm.modeling.config_base import ConfigError

TINY_TIMM_NAME = "vit_tiny_patch16_224"
TINY_TIMM_KWARGS = {"img_size": 16, "patch_size": 4, "embed_dim": 64, "depth": 2, "num_heads": 4}
TINY_CLIP_NAME = "cmoe-test-tiny-clip"
TINY_CLIP_CONFIG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 16, "layers": 3, "width": 32, "head_width": 16, "patch_size": 4},
    "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 16, "heads": 2, "layers": 1},
}


@pytest.fixture(scope="module")
def digit_images():
    digits = load_digits()
    pixels_N88 = (digits.images[:3] * (255 / 16)).astype(np.uint8)
    return [Image.fromarray(p) for p in pixels_N88]


@pytest.fixture(scope="module")
def tiny_clip_name(tmp_path_factory):
    config_path = tmp_path_factory.mktemp("open_clip_cfg") / f"{TINY_CLIP_NAME}.json"
    config_path.write_text(json.dumps(TINY_CLIP_CONFIG))
    open_clip.add_model_config(config_path)
    return TINY_CLIP_NAME


def _tiny_timm_reference(**overrides):
    torch.manual_seed(0)
    return timm.create_model(TINY_TIMM_NAME, num_classes=0, **{**TINY_TIMM_KWARGS, **overrides}).eval()


def _block_output(model, block, pixel_values_BCHW):
    """Output of ``block`` (a submodule of ``model``) during ``model(pixel_values_BCHW)``."""
    captured = []
    handle = block.register_forward_hook(lambda _module, _inputs, output: captured.append(output))
    with torch.no_grad():
        model(pixel_values_BCHW)
    handle.remove()
    return captured[0]


def _features(encoder, pixel_values_BCHW):
    with torch.no_grad():
        return encoder.eval()(pixel_values_BCHW)


def _pattern_image():
    """A non-square RGBA picture with varied pixels and alpha (exercises to_rgb and the resize)."""
    return Image.fromarray(((np.arange(20 * 11 * 4).reshape(20, 11, 4) * 37) % 256).astype(np.uint8), "RGBA")


def _reference_pixels(image, size, mean, std):
    """The preprocessing as the pipeline spelled it out before the encoder owned it."""
    return transforms.Compose([
        transforms.Resize((size, size), interpolation=transforms.InterpolationMode.BICUBIC, antialias=True),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])(to_rgb(image))


def test_tiny_vit_shapes_and_transform(digit_images):
    encoder = build_vision_encoder(VisionEncoderConfig(backbone="tiny-vit"))
    assert (encoder.image_size, encoder.patch_grid, encoder.num_patches, encoder.embed_dim) == (16, (4, 4), 16, 64)

    transform = encoder.image_transform()
    assert isinstance(transform, ImageTransform) and transform == ImageTransform(16, [0.5] * 3, [0.5] * 3, "bicubic")
    image_CHW = transform(digit_images[0])
    assert digit_images[0].size == (8, 8) and digit_images[0].mode == "L"
    assert image_CHW.shape == (3, 16, 16) and image_CHW.dtype == torch.float32
    assert torch.equal(image_CHW[0], image_CHW[1])  # grayscale replicated to RGB

    pixel_values_BCHW = torch.stack([transform(image) for image in digit_images])
    features_BPD = _features(encoder, pixel_values_BCHW)
    assert features_BPD.shape == (3, 16, 64) and features_BPD.dtype == torch.float32


def test_transform_normalizes_with_backbone_stats():
    encoder = build_vision_encoder(VisionEncoderConfig(backbone="tiny-vit"))  # timm mean = std = 0.5
    white_CHW = encoder.image_transform()(Image.new("L", (8, 8), 255))
    assert torch.allclose(white_CHW, torch.ones(3, 16, 16))


# (backbone, image) -> float64 sum of the pixel values the preprocessing produced before this API
# (vlm.modeling.image_transform.ImageTransform configured from the encoder by the trainer).
GOLDEN_PIXEL_SUMS = {
    ("tiny", "digit"): -316.8470513820648, ("tiny", "pattern"): 360.6274744272232,
    ("clip", "digit"): -445.9676038266625, ("clip", "pattern"): 814.8372442852706,
}


def test_image_transform_pixels_unchanged(digit_images, tiny_clip_name):
    tiny = build_vision_encoder(VisionEncoderConfig(backbone="tiny-vit"))
    clip = build_vision_encoder(VisionEncoderConfig(backbone="open_clip", model_name=tiny_clip_name))
    clip_mean, clip_std = open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD
    assert clip.image_transform() == ImageTransform(16, clip_mean, clip_std, "bicubic")
    for backbone, encoder, mean, std in [("tiny", tiny, [0.5] * 3, [0.5] * 3), ("clip", clip, clip_mean, clip_std)]:
        for name, image in [("digit", digit_images[0]), ("pattern", _pattern_image())]:
            pixels_CHW = encoder.image_transform()(image)
            assert torch.equal(pixels_CHW, _reference_pixels(image, 16, mean, std)), (backbone, name)
            assert float(pixels_CHW.double().sum()) == pytest.approx(GOLDEN_PIXEL_SUMS[backbone, name], abs=1e-4)


def test_image_transform_follows_the_library_settings():
    overlay = {"pretrained_cfg_overlay": {"interpolation": "bilinear", "mean": (0.1, 0.2, 0.3)}}
    encoder = build_vision_encoder(VisionEncoderConfig(backbone="tiny-vit", image_size=32, model_kwargs=overlay))
    assert encoder.image_transform() == ImageTransform(32, [0.1, 0.2, 0.3], [0.5] * 3, "bilinear")
    lanczos = {"pretrained_cfg_overlay": {"interpolation": "lanczos"}}  # not an ImageTransform mode
    encoder = build_vision_encoder(VisionEncoderConfig(backbone="tiny-vit", model_kwargs=lanczos))
    assert encoder.image_transform().resample == "bicubic"
    assert encoder.image_transform() is not encoder.image_transform()  # callers may not share mutable state


def test_keep_cls_and_image_size_override():
    encoder = build_vision_encoder(VisionEncoderConfig(backbone="tiny-vit", keep_cls=True, image_size=32))
    assert (encoder.image_size, encoder.patch_grid, encoder.num_patches) == (32, (8, 8), 65)
    assert _features(encoder, torch.randn(2, 3, 32, 32)).shape == (2, 65, 64)
    small = build_vision_encoder(VisionEncoderConfig(backbone="small-vit"))
    assert (small.image_size, small.num_patches, small.embed_dim) == (32, 64, 128)


@pytest.mark.parametrize("feature_layer", ["last", "penultimate"])
def test_timm_features_match_library(tmp_path, feature_layer):
    reference = _tiny_timm_reference()
    weights = tmp_path / "tiny_vit.safetensors"
    save_file(reference.state_dict(), weights)
    encoder = build_vision_encoder(
        VisionEncoderConfig(backbone="tiny-vit", pretrained=str(weights), feature_layer=feature_layer)
    )
    pixel_values_BCHW = torch.randn(2, 3, 16, 16)
    if feature_layer == "last":
        with torch.no_grad():
            expected_BTD = reference.forward_features(pixel_values_BCHW)
    else:
        expected_BTD = _block_output(reference, reference.blocks[-2], pixel_values_BCHW)
    torch.testing.assert_close(_features(encoder, pixel_values_BCHW), expected_BTD[:, 1:], rtol=0, atol=1e-6)


def test_timm_keep_cls_drops_register_tokens(tmp_path):
    reference = _tiny_timm_reference(reg_tokens=2)
    weights = tmp_path / "tiny_vit_reg.safetensors"
    save_file(reference.state_dict(), weights)
    cfg = VisionEncoderConfig(
        backbone="timm", model_name=TINY_TIMM_NAME, pretrained=str(weights), keep_cls=True,
        model_kwargs={**TINY_TIMM_KWARGS, "reg_tokens": 2},
    )
    encoder = build_vision_encoder(cfg)
    pixel_values_BCHW = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        expected_BTD = reference.forward_features(pixel_values_BCHW)  # [CLS, reg, reg, 16 patches]
    assert encoder.num_patches == 17
    expected_BPD = torch.cat([expected_BTD[:, :1], expected_BTD[:, 3:]], dim=1)
    torch.testing.assert_close(_features(encoder, pixel_values_BCHW), expected_BPD, rtol=0, atol=1e-6)


def test_pickle_weights_need_trust_pickle(tmp_path):
    reference = _tiny_timm_reference()
    weights = tmp_path / "tiny_vit.pth"
    torch.save(reference.state_dict(), weights)
    with pytest.raises(ValueError, match="trust_pickle"):
        build_vision_encoder(VisionEncoderConfig(backbone="tiny-vit", pretrained=str(weights)))
    encoder = build_vision_encoder(VisionEncoderConfig(backbone="tiny-vit", pretrained=str(weights), trust_pickle=True))
    pixel_values_BCHW = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        expected_BPD = reference.forward_features(pixel_values_BCHW)[:, 1:]
    torch.testing.assert_close(_features(encoder, pixel_values_BCHW), expected_BPD, rtol=0, atol=1e-6)


@pytest.mark.parametrize("feature_layer", ["last", "penultimate"])
def test_open_clip_features_match_library(tmp_path, tiny_clip_name, feature_layer):
    torch.manual_seed(0)
    reference = open_clip.create_model(tiny_clip_name).eval()
    weights = tmp_path / "tiny_clip.safetensors"
    save_file(reference.state_dict(), weights)
    encoder = build_vision_encoder(VisionEncoderConfig(
        backbone="open_clip", model_name=tiny_clip_name, pretrained=str(weights),
        feature_layer=feature_layer, keep_cls=True,
    ))
    assert (encoder.image_size, encoder.patch_grid, encoder.num_patches, encoder.embed_dim) == (16, (4, 4), 17, 32)
    visual = reference.visual
    pixel_values_BCHW = torch.randn(2, 3, 16, 16)
    features_BPD = _features(encoder, pixel_values_BCHW)
    if feature_layer == "last":
        visual.output_tokens = True
        with torch.no_grad():
            _, patches_BND = visual(pixel_values_BCHW)
        torch.testing.assert_close(features_BPD[:, 1:], patches_BND, rtol=0, atol=1e-6)
        expected_BPD = _block_output(visual, visual.ln_post, pixel_values_BCHW)  # [CLS, patches] after ln_post
    else:
        expected_BPD = _block_output(visual, visual.transformer.resblocks[-2], pixel_values_BCHW)
    torch.testing.assert_close(features_BPD, expected_BPD, rtol=0, atol=1e-6)


def test_missing_weights_file_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "weights.safetensors"
    with pytest.raises(FileNotFoundError, match="weights.safetensors") as info:
        build_vision_encoder(VisionEncoderConfig(backbone="tiny-vit", pretrained=str(missing)))
    assert str(missing) in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"feature_layer": "middle"}, "vision.feature_layer"),
        ({"image_size": 0}, "vision.image_size"),
        ({"keep_cls": "yes"}, "vision.keep_cls"),
        ({"trust_pickle": 1}, "vision.trust_pickle"),
        ({"model_kwargs": ["depth", 2]}, "vision.model_kwargs"),
        ({"pretrained": ""}, "vision.pretrained"),
        ({"backbone": ""}, "vision.backbone"),
        ({"image_aspect": "crop"}, "vision.image_aspect"),
        ({"model_name": "hf-hub:no-slash"}, "vision.model_name"),
        ({"model_name": "hf-hub:"}, "vision.model_name"),
    ],
)
def test_bad_config_values_name_the_field(kwargs, field):
    from vlm.modeling.config_base import ConfigError, build

    with pytest.raises(ValueError, match=field.split(".")[1]):  # direct construction: pydantic names the field
        VisionEncoderConfig(**{"backbone": "tiny-vit", **kwargs})
    with pytest.raises(ConfigError, match=rf"^config error: {field}: "):  # the config route: the dotted field
        build(VisionEncoderConfig, {"backbone": "tiny-vit", **kwargs}, "vision.")


def test_build_errors():
    """Build errors are one-line ConfigErrors (ValueErrors the trainer turns into exit 2) naming the field."""
    with pytest.raises(ConfigError, match=r"^config error: vision.backbone: .*known ids: .*tiny-vit"):
        build_vision_encoder(VisionEncoderConfig(backbone="huge-vit"))
    with pytest.raises(ConfigError, match=r"^config error: vision.model_name: is required for backbone 'timm'$"):
        build_vision_encoder(VisionEncoderConfig(backbone="timm"))
    with pytest.raises(ConfigError, match=r"^config error: vision.pretrained: is required for backbone 'clip-vit"):
        build_vision_encoder(VisionEncoderConfig(backbone="clip-vit-l-336"))
    with pytest.raises(ConfigError, match="^config error: vision.keep_cls: true but"):
        build_vision_encoder(VisionEncoderConfig(
            backbone="timm", model_name=TINY_TIMM_NAME, keep_cls=True,
            model_kwargs={**TINY_TIMM_KWARGS, "class_token": False, "global_pool": "avg"},
        ))
    with pytest.raises(ConfigError, match=r"^config error: vision.model_name: 'resnet18' is not a timm Vision Tr"):
        build_vision_encoder(VisionEncoderConfig(backbone="timm", model_name="resnet18"))
    with pytest.raises(ConfigError, match=r"^config error: vision.model_name: timm 'vit_tiny_patch16_224': TypeError"):
        build_vision_encoder(VisionEncoderConfig(backbone="tiny-vit", model_kwargs={"no_such_kwarg": 1}))
    encoder = build_vision_encoder(VisionEncoderConfig(backbone="tiny-vit"))
    with pytest.raises(ValueError, match=r"\[B, 3, 16, 16\]"):
        encoder(torch.randn(1, 3, 32, 32))


def test_random_init_is_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="vision_encoders")
    first = build_vision_encoder(VisionEncoderConfig(backbone="tiny-vit"))
    torch.manual_seed(0)
    again = build_vision_encoder(VisionEncoderConfig(backbone="tiny-vit"))
    lines = [r.getMessage() for r in caplog.records if r.name == "vision_encoders"]
    assert len(lines) == 2 and lines[0] == first.load_line
    num_tensors = len(first.state_dict())
    assert re.fullmatch(rf"vision: timm 'vit_tiny_patch16_224' <- random init \(vision.pretrained: null\): "
                        rf"{num_tensors} tensors, sha1 [0-9a-f]{{8}}", lines[0]), lines[0]
    assert (lines[0] == lines[1]) == all(torch.equal(a, b) for a, b in
                                         zip(first.state_dict().values(), again.state_dict().values()))


def test_local_file_load_is_logged(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="vision_encoders")
    reference = _tiny_timm_reference()
    weights = tmp_path / "tiny_vit.safetensors"
    save_file(reference.state_dict(), weights)
    encoder = build_vision_encoder(VisionEncoderConfig(backbone="tiny-vit", pretrained=str(weights)))
    assert encoder.load_line == f"vision: timm 'vit_tiny_patch16_224' <- file {weights}: " \
                                f"{len(reference.state_dict())} tensors, {weights_digest(reference)[1]}"
    assert [r.getMessage() for r in caplog.records if r.name == "vision_encoders"] == [encoder.load_line]


def test_image_aspect_pad_pads_with_the_mean_colour():
    """pad: LLaVA-1.5's expand2square (centred on the mean colour, int(255 * mean)), then the resize."""
    image = Image.fromarray(((np.arange(6 * 12 * 3).reshape(6, 12, 3) * 53) % 256).astype(np.uint8), "RGB")
    mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    encoder = build_vision_encoder(VisionEncoderConfig(
        backbone="tiny-vit", image_aspect="pad",
        model_kwargs={"pretrained_cfg_overlay": {"mean": tuple(mean), "std": tuple(std)}},
    ))
    transform = encoder.image_transform()
    assert transform.settings()["image_aspect"] == "pad" and ImageTransform(**transform.settings()) == transform
    expected = Image.new("RGB", (12, 12), tuple(int(255 * m) for m in mean))
    expected.paste(image, (0, 3))
    torch.testing.assert_close(transform(image), _reference_pixels(expected, 16, mean, std), rtol=0, atol=0)
    pixels_CHW = transform(image)
    fill_C = (torch.tensor([int(255 * m) for m in mean]) / 255 - torch.tensor(mean)) / torch.tensor(std)
    torch.testing.assert_close(pixels_CHW[:, 0, :], fill_C[:, None].expand(3, 16), rtol=0, atol=1e-5)  # top band
    resized = build_vision_encoder(VisionEncoderConfig(backbone="tiny-vit")).image_transform()
    assert resized.settings()["image_aspect"] == "resize" and not torch.equal(resized(image), transform(image))
    square = Image.new("RGB", (9, 9), (10, 200, 30))
    assert torch.equal(transform(square), _reference_pixels(square, 16, mean, std))  # a square is not padded
    with pytest.raises(ValueError, match="image_aspect"):
        ImageTransform(16, image_aspect="crop")


def test_pretrained_presets_name_real_library_models():
    for backbone_id in ("siglip-so400m", "clip-vit-l-336"):
        cls, kwargs = VISION_BACKBONES[backbone_id]
        assert kwargs["requires_weights"]
        if cls is TimmViTEncoder:
            assert timm.is_model(kwargs["model_name"])
        else:
            assert cls is OpenClipViTEncoder and kwargs["model_name"] in open_clip.list_models()


def test_register_vision_backbone():
    register_vision_backbone("test-wide-vit", TimmViTEncoder, model_name=TINY_TIMM_NAME,
                             model_kwargs={**TINY_TIMM_KWARGS, "embed_dim": 96})
    try:
        encoder = build_vision_encoder(VisionEncoderConfig(backbone="test-wide-vit", model_kwargs={"depth": 1}))
        assert encoder.embed_dim == 96 and len(encoder.model.blocks) == 1
        with pytest.raises(ValueError, match="already registered"):
            register_vision_backbone("test-wide-vit", TimmViTEncoder)
    finally:
        VISION_BACKBONES.pop("test-wide-vit")
