"""ConceptMoEImageProcessor: the vision backbone's image transform as a transformers image processor.

A thin ``BaseImageProcessor`` around ``vlm.modeling.image_transform.ImageTransform`` (the transform training
uses), so its pixels are the training pixels bit for bit. Its settings are the transform's
constructor arguments (image_size, image_mean, image_std, resample, image_aspect and, with
image_aspect "anyres", anyres_grids); ``save_pretrained`` / ``to_dict`` write exactly those plus
``image_processor_type``. Importing this module registers it with ``AutoImageProcessor`` for
``ConceptMoEVLMConfig``.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from transformers import AutoImageProcessor
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature

from .image_transform import ANYRES_GRIDS, ImageTransform
from .configuration_conceptmoe_vl import ConceptMoEVLMConfig


class ConceptMoEImageProcessor(BaseImageProcessor):
    """PIL images -> ``pixel_values`` Float[N, 3, S, S]: every view of every picture, in order.

        ip = ConceptMoEImageProcessor(image_size=384, image_aspect="anyres")   # or .from_transform(t)
        ip(images)["pixel_values"]; ip.image_tiles(images) -> views per picture (1, or 1 + cols*rows)

    A picture gives ``num_views`` views: 1 (image_aspect "resize" / "pad"), or with "anyres" a
    padded thumbnail + the tiles of its best grid. Inputs: a PIL image, a path / URL (loaded by
    transformers' ``load_image``), an HxWxC uint8 array, or a (nested) list of them.
    """

    model_input_names = ["pixel_values"]

    def __init__(self, image_size: int = 224, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
                 resample: str = "bicubic", image_aspect: str = "resize", anyres_grids=ANYRES_GRIDS, **kwargs):
        kwargs.pop("image_processor_type", None)
        if kwargs:
            raise TypeError(f"ConceptMoEImageProcessor got unknown settings {sorted(kwargs)}")
        super().__init__()
        self._transform = ImageTransform(image_size, image_mean, image_std, resample, image_aspect, anyres_grids)

    @classmethod
    def from_transform(cls, transform: ImageTransform) -> ConceptMoEImageProcessor:
        return cls(**transform.settings())

    @property
    def transform(self) -> ImageTransform:
        """The ``ImageTransform`` this processor applies (training's own class)."""
        return self._transform

    image_size = property(lambda self: self._transform.image_size)
    image_mean = property(lambda self: list(self._transform.image_mean))
    image_std = property(lambda self: list(self._transform.image_std))
    resample = property(lambda self: self._transform.resample)
    image_aspect = property(lambda self: self._transform.image_aspect)
    anyres_grids = property(lambda self: [list(grid) for grid in self._transform.anyres_grids])
    size = property(lambda self: {"height": self.image_size, "width": self.image_size})

    def to_dict(self) -> dict:
        return {**self._transform.settings(), "image_processor_type": type(self).__name__}

    # ----- images -----
    def load(self, images) -> list[Image.Image]:
        """A picture or a (nested) list of them -> a flat list of PIL images."""
        flat = []
        for image in _flatten(images):
            if isinstance(image, str):
                image = self.fetch_images(image)
            elif isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim in (2, 3):
                image = Image.fromarray(image)
            if not isinstance(image, Image.Image):
                raise TypeError(f"images must be PIL images, paths / URLs or uint8 HxWxC arrays, got {type(image).__name__}")
            flat.append(image)
        return flat

    def num_views(self, image: Image.Image) -> int:
        return self._transform.num_views(*image.size)

    def image_tiles(self, images) -> list[int]:
        """Views per picture, from the sizes alone."""
        return [self.num_views(image) for image in self.load(images)]

    def preprocess(self, images, return_tensors="pt", **kwargs) -> BatchFeature:
        """``{"pixel_values": Float[N, 3, S, S]}`` (N = sum of ``image_tiles``), or None without images."""
        if kwargs:
            raise TypeError(f"ConceptMoEImageProcessor.preprocess got unknown arguments {sorted(kwargs)}")
        if return_tensors not in ("pt", None):
            raise ValueError(f"return_tensors must be 'pt' or None, got {return_tensors!r}")
        flat = self.load(images)
        pixel_values = torch.cat([self._transform.views(image) for image in flat]) if flat else None
        return BatchFeature({"pixel_values": pixel_values})

    def __call__(self, images, **kwargs) -> BatchFeature:
        return self.preprocess(images, **kwargs)

    def __eq__(self, other) -> bool:
        return isinstance(other, ConceptMoEImageProcessor) and self.to_dict() == other.to_dict()

    __hash__ = None


def _flatten(images):
    if images is None:
        return
    if isinstance(images, (list, tuple)):
        for item in images:
            yield from _flatten(item)
    else:
        yield images


AutoImageProcessor.register(ConceptMoEVLMConfig, image_processor_classes={"torchvision": ConceptMoEImageProcessor},
                            exist_ok=True)
ConceptMoEImageProcessor.register_for_auto_class("AutoImageProcessor")  # saved alone: its code and auto_map
