"""transformers CLIP / SigLIP / SigLIP2 vision towers from a local folder or a hub id in the local HF
cache, with the size / mean / std / resample of the saved preprocessor config."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig

from .vision_base import (
    META_SOURCE,
    VisionEncoder,
    VisionEncoderConfig,
    check_tower,
    on_meta_device,
    resolve_model_name,
)
from .vision_hub import HUB_REPO_RE, hub_cache_dir, hub_id, library_errors, require_cached
from .config_base import fail

KEY = "vision.model_name"
# config.model_type -> the vision tower class (a full CLIP / SigLIP checkpoint loads its vision tower)
MODEL_CLASSES = {
    "clip": "CLIPVisionModel", "clip_vision_model": "CLIPVisionModel",
    "siglip": "SiglipVisionModel", "siglip_vision_model": "SiglipVisionModel",
    "siglip2": "Siglip2VisionModel", "siglip2_vision_model": "Siglip2VisionModel",
}
PIL_RESAMPLE = {0: "nearest", 2: "bilinear", 3: "bicubic"}


def _locate(name: str) -> tuple[str, Path, str]:
    """(reference for ``from_pretrained``, folder holding its files, log source)."""
    ref = hub_id(name) or name
    local = Path(ref).expanduser()
    if local.is_dir():
        return str(local.resolve()), local.resolve(), f"folder {local.resolve()}"
    if hub_id(name) is None and (ref.startswith(("/", "~", ".")) or not HUB_REPO_RE.fullmatch(ref)):
        raise fail(KEY, f"folder not found: {local.resolve()} (backbone 'hf' takes a model folder or a hub id "
                        "in the local Hugging Face cache)")
    config_path = require_cached(KEY, f"{ref!r} is not a local folder, and as a hub id", ref, ("config.json",))
    return ref, Path(config_path).parent, f"HF cache {Path(config_path).parent}"


def _vision_config(config):
    return getattr(config, "vision_config", config)


def _preprocessing(folder: Path, ref: str, config, naflex: bool) -> dict:
    """image_size / image_mean / image_std / interpolation from the saved preprocessor config."""
    path = folder / "preprocessor_config.json"
    if not path.is_file():
        raise fail(KEY, f"no preprocessor_config.json for {ref!r} in {folder} (hub cache {hub_cache_dir()})")
    pre = json.loads(path.read_text())
    vision = _vision_config(config)
    if naflex:  # SigLIP2 NaFlex: the largest square grid within max_num_patches
        grid = math.isqrt(int(pre.get("max_num_patches", vision.num_patches)))
        size = grid * int(pre.get("patch_size", vision.patch_size))
    else:
        box = pre.get("crop_size") if pre.get("do_center_crop") else pre.get("size")
        box = box if isinstance(box, dict) else {"height": box or vision.image_size}
        size = box.get("height", box.get("shortest_edge", vision.image_size))
    return {"image_size": int(size), "image_mean": pre.get("image_mean", (0.5,) * 3),
            "image_std": pre.get("image_std", (0.5,) * 3),
            "interpolation": PIL_RESAMPLE.get(pre.get("resample", 3), "bicubic")}


class HFViTEncoder(VisionEncoder):
    """``CLIPVisionModel`` / ``SiglipVisionModel`` / ``Siglip2VisionModel`` ``.from_pretrained(ref)``.

    ``vision.model_name`` is a folder or a hub id (``org/name`` or ``hf-hub:org/name``) resolved
    offline by transformers; ``vision.pretrained`` must be null (the folder holds the weights), a
    weight missing from the checkpoint is an error (never random), pickle files need ``trust_pickle``.
    "last" is ``post_layernorm`` over the final block's tokens (CLIP applies it to CLS only; SigLIP's
    ``last_hidden_state``), "penultimate" the raw second-to-last block. CLIP has a CLS token.
    The transform squashes to the processor's square size (CLIP's processor resizes the short side
    and centre-crops). SigLIP2 (NaFlex) gets the patches of a square image, all valid.
    """

    def __init__(self, cfg: VisionEncoderConfig, *, model_name: str | None = None,
                 model_kwargs: dict | None = None, requires_weights: bool = False) -> None:
        name = resolve_model_name(cfg, model_name)
        if cfg.pretrained is not None:
            raise fail("vision.pretrained", "must be null for backbone 'hf' (vision.model_name holds the weights)")
        ref, folder, source = _locate(name)
        with library_errors(KEY, f"hf {name!r}"):
            config = AutoConfig.from_pretrained(ref)
        class_name = MODEL_CLASSES.get(config.model_type)
        if class_name is None or not hasattr(transformers, class_name):
            raise fail(KEY, f"{name!r} is a {config.model_type!r} model; backbone 'hf' takes "
                            f"{', '.join(sorted(set(MODEL_CLASSES)))}")
        naflex = class_name == "Siglip2VisionModel"
        pre = _preprocessing(folder, ref, config, naflex)
        kwargs = {**(model_kwargs or {}), **cfg.model_kwargs}
        model_class = getattr(transformers, class_name)
        with library_errors(KEY, f"hf {name!r}"):
            if on_meta_device():  # inside a from_pretrained: the architecture only
                model, info, source = model_class._from_config(_vision_config(config), **kwargs), None, META_SOURCE
            else:
                model, info = model_class.from_pretrained(
                    ref, output_loading_info=True, use_safetensors=None if cfg.trust_pickle else True, **kwargs)
        if info and info["missing_keys"]:
            missing = sorted(info["missing_keys"])
            raise fail(KEY, f"{len(missing)} weights of {class_name} are not in {source} (e.g. {missing[0]}); "
                            "they would be random")
        vision = model.config
        image_size = cfg.image_size or pre["image_size"]
        if image_size % vision.patch_size:
            raise fail("vision.image_size", f"{image_size} is not a multiple of the patch size {vision.patch_size}")
        check_tower(cfg, name, vision.num_hidden_layers, (image_size, image_size))
        grid = image_size // vision.patch_size
        super().__init__(cfg, image_size=image_size, patch_grid=(grid, grid), embed_dim=vision.hidden_size,
                         has_cls_token=class_name == "CLIPVisionModel", image_mean=pre["image_mean"],
                         image_std=pre["image_std"], interpolation=pre["interpolation"])
        self.model = model
        self._naflex, self._has_cls = naflex, class_name == "CLIPVisionModel"
        self._interpolate = not naflex and image_size != vision.image_size
        self.log_weights(f"hf {class_name} {name!r}", source)

    def _patches(self, pixel_values_BCHW: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> [B, N, p*p*3], each patch row-major (p, p, C) as Siglip2ImageProcessor makes it."""
        batch, channels, _, _ = pixel_values_BCHW.shape
        p, (grid_h, grid_w) = self.model.config.patch_size, self.patch_grid
        x_BChpwq = pixel_values_BCHW.reshape(batch, channels, grid_h, p, grid_w, p)
        return x_BChpwq.permute(0, 2, 4, 3, 5, 1).reshape(batch, grid_h * grid_w, p * p * channels)

    def forward_tokens(self, pixel_values_BCHW: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        if self._naflex:
            patches_BNC = self._patches(pixel_values_BCHW)
            batch, num_patches, _ = patches_BNC.shape
            out = self.model(
                pixel_values=patches_BNC,
                pixel_attention_mask=torch.ones(batch, num_patches, dtype=torch.long, device=patches_BNC.device),
                spatial_shapes=torch.tensor([self.patch_grid] * batch, device=patches_BNC.device),
                output_hidden_states=True,
            )
        else:
            out = self.model(pixel_values=pixel_values_BCHW, output_hidden_states=True,
                             interpolate_pos_encoding=self._interpolate)
        if self.cfg.feature_layer == "last":
            tokens_BTD = self.model.post_layernorm(out.hidden_states[-1])
        else:
            tokens_BTD = out.hidden_states[-2]
        if self._has_cls:
            return tokens_BTD[:, 0], tokens_BTD[:, 1:]
        return None, tokens_BTD
