"""Pretrained vision encoders from a local Hugging Face cache (HF_HUB_OFFLINE=1, nothing downloaded).

Each test writes random weights with the library's own writer into a temporary hub cache
(models--org--name/snapshots/<rev>/..., refs/main) and checks our features against the library's
own model loaded the same way (timm.create_model, open_clip.create_model_and_transforms,
transformers from_pretrained), the preprocessing, the one load line, and the one-line errors.
"""

import json
import logging
import re
import socket

import open_clip
import pytest
import timm
import torch
import transformers
from huggingface_hub import constants as hub_constants
from open_clip.push_to_hf_hub import save_config_for_hf
from safetensors.torch import load_file, save_file
from timm.models._hub import save_for_hf as timm_save_for_hf

from vlm.modeling.vision_base import VisionEncoderConfig
from vlm.modeling.vision_registry import build_vision_encoder
from vlm.modeling.vision_hub import weights_digest
from vlm.modeling.config_base import ConfigError

TINY_TIMM_KWARGS = {"img_size": 16, "patch_size": 4, "embed_dim": 64, "depth": 2, "num_heads": 4}
TINY_CLIP_CONFIG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 16, "layers": 3, "width": 32, "head_width": 16, "patch_size": 4},
    "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 16, "heads": 2, "layers": 1},
}
TINY_HF = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
           "patch_size": 4}
REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty offline HF cache in tmp_path; ``hub_cache(repo_id)`` makes a repo's snapshot folder."""
    home = tmp_path / "hf_home"
    cache = home / "hub"
    for var, value in {"HF_HOME": home, "HF_HUB_CACHE": cache, "HF_HUB_OFFLINE": "1"}.items():
        monkeypatch.setenv(var, str(value))
    # huggingface_hub reads the variables once at import: point its module constants there too
    monkeypatch.setattr(hub_constants, "HF_HOME", str(home))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)

    def snapshot(repo_id: str):
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(REVISION)
        folder = repo / "snapshots" / REVISION
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    snapshot.root = cache
    return snapshot


def _features(encoder, pixel_values_BCHW):
    with torch.no_grad():
        return encoder.eval()(pixel_values_BCHW)


def _load_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "vision_encoders"]


def _one_line_error(expected: str, cfg: VisionEncoderConfig) -> str:
    with pytest.raises(ConfigError) as info:
        build_vision_encoder(cfg)
    message = str(info.value)
    assert "\n" not in message and re.match(expected, message), message
    return message


# ----- timm -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("feature_layer", ["last", "penultimate"])
def test_timm_tag_loads_from_hub_cache(hub_cache, caplog, feature_layer):
    """vit_base_patch16_clip_224.openai (once silently random) loads the tag's weights with pretrained=True."""
    caplog.set_level(logging.INFO, logger="vision_encoders")
    name = "vit_base_patch16_clip_224.openai"
    torch.manual_seed(0)
    written = timm.create_model(name, num_classes=0, **TINY_TIMM_KWARGS)
    repo = timm.models.get_pretrained_cfg(name).hf_hub_id
    save_file(written.state_dict(), hub_cache(repo) / "model.safetensors")
    encoder = build_vision_encoder(VisionEncoderConfig(backbone="timm", model_name=name, keep_cls=True,
                                                       feature_layer=feature_layer, model_kwargs=TINY_TIMM_KWARGS))
    reference = timm.create_model(name, pretrained=True, num_classes=0, **TINY_TIMM_KWARGS).eval()
    pixel_values_BCHW = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        if feature_layer == "last":
            expected_BTD = reference.forward_features(pixel_values_BCHW)
        else:
            expected_BTD = reference.forward_intermediates(pixel_values_BCHW, indices=[0], norm=False,
                                                           intermediates_only=True, output_fmt="NLC",
                                                           return_prefix_tokens=True, output_dict=True)
            expected_BTD = torch.cat([expected_BTD["image_intermediates_prefix"][0],
                                      expected_BTD["image_intermediates"][0]], dim=1)
    torch.testing.assert_close(_features(encoder, pixel_values_BCHW), expected_BTD, rtol=0, atol=1e-6)
    assert weights_digest(encoder.model) == weights_digest(written)  # the cached tensors, not a random init
    transform = encoder.image_transform().settings()
    assert transform["image_mean"] == list(open_clip.OPENAI_DATASET_MEAN) and transform["image_size"] == 16
    path = hub_cache.root / f"models--{repo.replace('/', '--')}" / "snapshots" / REVISION / "model.safetensors"
    count, digest = weights_digest(written)
    assert _load_lines(caplog) == [f"vision: timm {name!r} <- HF cache {path}: {count} tensors, {digest}"]


def test_timm_hf_hub_repo(hub_cache):
    torch.manual_seed(1)
    written = timm.create_model("vit_tiny_patch16_224", num_classes=0, **TINY_TIMM_KWARGS)
    timm_save_for_hf(written, hub_cache("test-org/tiny-timm-vit"), model_args=TINY_TIMM_KWARGS,
                     safe_serialization=True)
    encoder = build_vision_encoder(VisionEncoderConfig(backbone="timm", model_name="hf-hub:test-org/tiny-timm-vit"))
    reference = timm.create_model("hf-hub:test-org/tiny-timm-vit", pretrained=True, num_classes=0).eval()
    pixel_values_BCHW = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        expected_BPD = reference.forward_features(pixel_values_BCHW)[:, 1:]
    torch.testing.assert_close(_features(encoder, pixel_values_BCHW), expected_BPD, rtol=0, atol=1e-6)
    assert weights_digest(encoder.model) == weights_digest(written)


def test_loads_never_touch_the_network(hub_cache, monkeypatch):
    """Even without HF_HUB_OFFLINE the loaders resolve from the cache only (no connection is opened)."""
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    connections = []
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: connections.append(a) or _refuse())
    monkeypatch.setattr(socket.socket, "connect", lambda self, *a: connections.append(a) or _refuse())
    name = "vit_tiny_patch16_224.augreg_in21k"
    written = timm.create_model(name, num_classes=0, **TINY_TIMM_KWARGS)
    save_file(written.state_dict(), hub_cache(timm.models.get_pretrained_cfg(name).hf_hub_id) / "model.safetensors")
    encoder = build_vision_encoder(VisionEncoderConfig(backbone="timm", model_name=name, model_kwargs=TINY_TIMM_KWARGS))
    assert weights_digest(encoder.model) == weights_digest(written) and connections == []
    assert hub_constants.HF_HUB_OFFLINE is False  # restored after the load


def _refuse():
    raise OSError("network access in a test")


def test_timm_errors_are_one_line(hub_cache):
    _one_line_error(r"config error: vision.model_name: 'vit_tinyy_patch16_224' is not a known timm model "
                    r"\(close: vit_tiny_patch16_224",
                    VisionEncoderConfig(backbone="timm", model_name="vit_tinyy_patch16_224"))
    _one_line_error(r"config error: vision.model_name: 'vit_tiny_patch16_224.bogus': 'bogus' is not a timm "
                    r"pretrained tag of vit_tiny_patch16_224 \(tags: augreg_in21k, augreg_in21k_ft_in1k\)$",
                    VisionEncoderConfig(backbone="timm", model_name="vit_tiny_patch16_224.bogus"))
    message = _one_line_error(r"config error: vision.model_name: timm 'vit_so400m_patch14_siglip_384.webli': "
                              r"model.safetensors / pytorch_model.bin of hub repo "
                              r"'timm/vit_so400m_patch14_siglip_384.webli' is not in the local Hugging Face cache ",
                              VisionEncoderConfig(backbone="siglip-so400m"))
    assert str(hub_cache.root) in message
    _one_line_error(r"config error: vision.model_name: timm 'hf-hub:test-org/absent': config.json of hub repo ",
                    VisionEncoderConfig(backbone="timm", model_name="hf-hub:test-org/absent"))
    _one_line_error(r"config error: vision.pretrained: 'webli' is not a local file; a timm pretrained tag goes in "
                    r"the model name \(vit_so400m_patch14_siglip_384.webli\)$",
                    VisionEncoderConfig(backbone="timm", model_name="vit_so400m_patch14_siglip_384",
                                        pretrained="webli"))


def test_timm_cached_pickle_needs_trust_pickle(hub_cache):
    name = "vit_tiny_patch16_224.augreg_in21k"
    written = timm.create_model(name, num_classes=0, **TINY_TIMM_KWARGS)
    torch.save(written.state_dict(), hub_cache(timm.models.get_pretrained_cfg(name).hf_hub_id) / "pytorch_model.bin")
    cfg = {"backbone": "timm", "model_name": name, "model_kwargs": TINY_TIMM_KWARGS}
    _one_line_error(r"config error: vision.model_name: refusing to unpickle .*pytorch_model.bin; ",
                    VisionEncoderConfig(**cfg))
    encoder = build_vision_encoder(VisionEncoderConfig(**cfg, trust_pickle=True))
    assert weights_digest(encoder.model) == weights_digest(written)


# ----- open_clip ------------------------------------------------------------------------------------
@pytest.fixture
def tiny_vit_b_16(monkeypatch):
    """open_clip's real ViT-B-16 name and tag table, with a tiny architecture behind the name."""
    monkeypatch.setitem(open_clip.factory._MODEL_CONFIGS, "ViT-B-16", TINY_CLIP_CONFIG)
    return "ViT-B-16"


def test_open_clip_tag_resolves_through_open_clip(hub_cache, tiny_vit_b_16, caplog):
    caplog.set_level(logging.INFO, logger="vision_encoders")
    tag = "laion2b_s34b_b88k"
    repo = open_clip.get_pretrained_cfg(tiny_vit_b_16, tag)["hf_hub"].rstrip("/")  # laion/CLIP-ViT-B-16-laion2B-...
    torch.manual_seed(2)
    written = open_clip.create_model(tiny_vit_b_16)
    save_file(written.state_dict(), hub_cache(repo) / "open_clip_model.safetensors")
    encoder = build_vision_encoder(VisionEncoderConfig(backbone="open_clip", model_name=tiny_vit_b_16,
                                                       pretrained=tag, keep_cls=True))
    reference, _, preprocess = open_clip.create_model_and_transforms(tiny_vit_b_16, pretrained=tag)
    visual = reference.eval().visual
    visual.output_tokens = True
    pixel_values_BCHW = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        _, patches_BND = visual(pixel_values_BCHW)
    torch.testing.assert_close(_features(encoder, pixel_values_BCHW)[:, 1:], patches_BND, rtol=0, atol=1e-6)
    assert weights_digest(encoder.visual) == weights_digest(written.visual)
    normalize = preprocess.transforms[-1]
    settings = encoder.image_transform().settings()
    assert (settings["image_mean"], settings["image_std"]) == (list(normalize.mean), list(normalize.std))
    assert len(_load_lines(caplog)) == 1 and f"<- HF cache {hub_cache.root}" in _load_lines(caplog)[0]


def test_open_clip_hf_hub_repo(hub_cache, tiny_vit_b_16):
    torch.manual_seed(3)
    written = open_clip.create_model(tiny_vit_b_16)
    folder = hub_cache("test-org/tiny-open-clip")
    save_config_for_hf(written, folder / "open_clip_config.json", model_config=TINY_CLIP_CONFIG)
    save_file(written.state_dict(), folder / "open_clip_model.safetensors")
    encoder = build_vision_encoder(VisionEncoderConfig(backbone="open_clip", feature_layer="penultimate",
                                                       model_name="hf-hub:test-org/tiny-open-clip"))
    reference, _, _ = open_clip.create_model_and_transforms("hf-hub:test-org/tiny-open-clip")
    visual = reference.eval().visual
    pixel_values_BCHW = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        out = visual.forward_intermediates(pixel_values_BCHW, indices=[1], intermediates_only=True,
                                           output_fmt="NLC", normalize_intermediates=False)
    torch.testing.assert_close(_features(encoder, pixel_values_BCHW), out["image_intermediates"][0], rtol=0, atol=1e-6)
    assert weights_digest(encoder.visual) == weights_digest(written.visual)


def test_open_clip_errors_are_one_line(hub_cache, tiny_vit_b_16):
    _one_line_error(r"config error: vision.pretrained: 'laion2b_s99b' is neither a local file nor an open_clip "
                    r"pretrained tag of 'ViT-B-16' \(tags: openai, .*laion2b_s34b_b88k",
                    VisionEncoderConfig(backbone="open_clip", model_name="ViT-B-16", pretrained="laion2b_s99b"))
    _one_line_error(r"config error: vision.model_name: 'ViT-B-61' is not a known open_clip model \(close: ViT-B-16",
                    VisionEncoderConfig(backbone="open_clip", model_name="ViT-B-61"))
    _one_line_error(r"config error: vision.pretrained: open_clip 'ViT-B-16' tag 'laion2b_s34b_b88k': "
                    r"open_clip_model.safetensors / open_clip_pytorch_model.bin of hub repo "
                    r"'laion/CLIP-ViT-B-16-laion2B-s34B-b88K' is not in the local Hugging Face cache",
                    VisionEncoderConfig(backbone="open_clip", model_name="ViT-B-16", pretrained="laion2b_s34b_b88k"))
    folder = hub_cache("test-org/config-only")  # open_clip itself would warn and go on with random weights
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": TINY_CLIP_CONFIG}))
    _one_line_error(r"config error: vision.model_name: open_clip 'hf-hub:test-org/config-only': open_clip_model",
                    VisionEncoderConfig(backbone="open_clip", model_name="hf-hub:test-org/config-only"))
    _one_line_error(r"config error: vision.pretrained: must be null with model_name 'hf-hub:test-org/config-only'",
                    VisionEncoderConfig(backbone="open_clip", model_name="hf-hub:test-org/config-only",
                                        pretrained="openai"))


def test_meta_device_build_reads_no_weights(hub_cache, tiny_vit_b_16, tmp_path, caplog):
    """Inside a VLM from_pretrained (meta device) the tower is the architecture only: nothing is read, so an
    empty cache is fine, and the tag's preprocessing still applies. Its load line is debug-level (it came
    with every model load, and says nothing was read)."""
    caplog.set_level(logging.DEBUG, logger="vision_encoders")
    _save_hf("siglip", tmp_path / "siglip")
    configs = [
        VisionEncoderConfig(backbone="timm", model_name="vit_base_patch16_clip_224.openai",
                            model_kwargs=TINY_TIMM_KWARGS),
        VisionEncoderConfig(backbone="open_clip", model_name=tiny_vit_b_16, pretrained="laion2b_s34b_b88k"),
        VisionEncoderConfig(backbone="open_clip", model_name=tiny_vit_b_16, pretrained=str(tmp_path / "absent.pt")),
        VisionEncoderConfig(backbone="hf", model_name=str(tmp_path / "siglip")),
    ]
    with torch.device("meta"):
        encoders = [build_vision_encoder(cfg) for cfg in configs]
    assert all(p.is_meta for encoder in encoders for p in encoder.parameters())
    assert encoders[0].image_transform().settings()["image_mean"] == list(open_clip.OPENAI_DATASET_MEAN)
    tag_mean = open_clip.get_pretrained_cfg(tiny_vit_b_16, "laion2b_s34b_b88k")["mean"]
    assert encoders[1].image_transform().settings()["image_mean"] == list(tag_mean)
    lines = _load_lines(caplog)
    assert len(lines) == 4 and all("<- the checkpoint being loaded (built on the meta device, nothing read here): "
                                   in line and line.endswith("tensors, no data yet") for line in lines), lines
    assert {r.levelno for r in caplog.records if r.name == "vision_encoders"} == {logging.DEBUG}


# ----- transformers ---------------------------------------------------------------------------------
def _save_hf(kind: str, folder, image_size: int = 16):
    """A random transformers vision model and its image processor, saved by transformers into ``folder``."""
    torch.manual_seed(4)
    if kind == "clip":
        model = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**TINY_HF, image_size=image_size))
        processor = transformers.CLIPImageProcessor(size={"shortest_edge": image_size},
                                                    crop_size={"height": image_size, "width": image_size})
    elif kind == "siglip":
        model = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**TINY_HF, image_size=image_size))
        processor = transformers.SiglipImageProcessor(size={"height": image_size, "width": image_size},
                                                      image_mean=[0.4, 0.5, 0.6], image_std=[0.2, 0.3, 0.4])
    else:
        model = transformers.Siglip2VisionModel(transformers.Siglip2VisionConfig(**TINY_HF, num_patches=16))
        processor = transformers.Siglip2ImageProcessor(patch_size=4, max_num_patches=16)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model.eval(), processor


@pytest.mark.parametrize("kind", ["clip", "siglip", "siglip2"])
@pytest.mark.parametrize("feature_layer", ["last", "penultimate"])
def test_hf_vision_models_match_transformers(hub_cache, caplog, kind, feature_layer):
    caplog.set_level(logging.INFO, logger="vision_encoders")
    repo = f"test-org/tiny-{kind}"
    written, processor = _save_hf(kind, hub_cache(repo))
    encoder = build_vision_encoder(VisionEncoderConfig(backbone="hf", model_name=repo, feature_layer=feature_layer,
                                                       keep_cls=kind == "clip"))
    model_class = type(written)
    reference = model_class.from_pretrained(repo).eval()
    pixel_values_BCHW = torch.randn(2, 3, 16, 16)
    inputs = {"pixel_values": pixel_values_BCHW}
    if kind == "siglip2":
        from transformers.models.siglip2.image_processing_siglip2 import convert_image_to_patches

        inputs = {"pixel_values": torch.stack([convert_image_to_patches(image, 4) for image in pixel_values_BCHW]),
                  "pixel_attention_mask": torch.ones(2, 16, dtype=torch.long),
                  "spatial_shapes": torch.tensor([[4, 4], [4, 4]])}
    with torch.no_grad():
        out = reference(**inputs, output_hidden_states=True)
    expected_BTD = reference.post_layernorm(out.hidden_states[-1]) if feature_layer == "last" else out.hidden_states[-2]
    if kind == "siglip" and feature_layer == "last":
        torch.testing.assert_close(expected_BTD, out.last_hidden_state, rtol=0, atol=0)
    assert encoder.num_patches == 16 + (kind == "clip")
    torch.testing.assert_close(_features(encoder, pixel_values_BCHW), expected_BTD, rtol=0, atol=1e-6)
    assert weights_digest(encoder.model) == weights_digest(written)
    settings = encoder.image_transform().settings()
    assert settings["image_size"] == 16
    assert settings["resample"] == {2: "bilinear", 3: "bicubic"}[int(processor.resample)]
    assert (settings["image_mean"], settings["image_std"]) == (list(processor.image_mean), list(processor.image_std))
    assert len(_load_lines(caplog)) == 1 and f"<- HF cache {hub_cache.root}" in _load_lines(caplog)[0]


def test_hf_folder_full_clip_checkpoint_and_image_size(tmp_path):
    """A full CLIPModel folder gives its vision tower; vision.image_size interpolates the positions."""
    torch.manual_seed(5)
    config = transformers.CLIPConfig(vision_config={**TINY_HF, "image_size": 16},
                                     text_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                                  "num_attention_heads": 2, "vocab_size": 64},
                                     projection_dim=8)
    transformers.CLIPModel(config).save_pretrained(tmp_path / "clip")
    transformers.CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
                                    resample=2).save_pretrained(tmp_path / "clip")
    encoder = build_vision_encoder(VisionEncoderConfig(backbone="hf", model_name=str(tmp_path / "clip"),
                                                       image_size=24))
    reference = transformers.CLIPVisionModel.from_pretrained(tmp_path / "clip").eval()
    assert encoder.image_transform().settings()["resample"] == "bilinear" and encoder.patch_grid == (6, 6)
    pixel_values_BCHW = torch.randn(1, 3, 24, 24)
    with torch.no_grad():
        out = reference(pixel_values=pixel_values_BCHW, interpolate_pos_encoding=True)
    expected_BPD = reference.post_layernorm(out.last_hidden_state)[:, 1:]
    torch.testing.assert_close(_features(encoder, pixel_values_BCHW), expected_BPD, rtol=0, atol=1e-6)
    assert encoder.load_line.startswith(f"vision: hf CLIPVisionModel '{tmp_path / 'clip'}' <- folder ")


def test_hf_errors_are_one_line(hub_cache, tmp_path):
    missing = tmp_path / "models" / "siglip-missing"
    _one_line_error(rf"config error: vision.model_name: folder not found: {re.escape(str(missing))} \(backbone "
                    r"'hf' takes a model folder or a hub id in the local Hugging Face cache\)$",
                    VisionEncoderConfig(backbone="hf", model_name=str(missing)))
    _one_line_error(r"config error: vision.model_name: 'google/siglip-absent' is not a local folder, and as a "
                    r"hub id: config.json of hub repo 'google/siglip-absent' is not in the local Hugging Face cache",
                    VisionEncoderConfig(backbone="hf", model_name="google/siglip-absent"))
    _save_hf("siglip", tmp_path / "siglip")
    _one_line_error(r"config error: vision.pretrained: must be null for backbone 'hf'",
                    VisionEncoderConfig(backbone="hf", model_name=str(tmp_path / "siglip"), pretrained="x.bin"))
    vit = tmp_path / "vit"
    transformers.ViTModel(transformers.ViTConfig(**TINY_HF, image_size=16)).save_pretrained(vit)
    _one_line_error(r"config error: vision.model_name: '.*vit' is a 'vit' model; backbone 'hf' takes clip, ",
                    VisionEncoderConfig(backbone="hf", model_name=str(vit)))
    # a checkpoint that lacks weights of the tower: an error, not a silent random init
    partial = tmp_path / "clip_partial"
    _save_hf("clip", partial)
    tensors = load_file(partial / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if "layers.2." not in k}, partial / "model.safetensors",
              metadata={"format": "pt"})
    _one_line_error(r"config error: vision.model_name: \d+ weights of CLIPVisionModel are not in folder .*"
                    r"\(e.g. encoder.layers.2.\S+\); they would be random$",
                    VisionEncoderConfig(backbone="hf", model_name=str(partial)))
