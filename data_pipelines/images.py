"""Safe image loading (`load_image`, `to_rgb`) and `ImageTransform`, the model's image preprocessing.

`load_image` returns a PIL RGB image or a `Skip` (`missing_image`, `corrupt_image`, `image_too_large`:
the pixel limit is checked on the header, before decoding); `to_rgb` maps every PIL mode to 8-bit RGB.
`ImageTransform` is built by the vision backbone (`VisionEncoder.image_transform()`).
"""

from __future__ import annotations

import io
import os
import warnings

import numpy as np
from PIL import Image, UnidentifiedImageError
from torchvision import transforms

from .common import Skip

DEFAULT_MAX_PIXELS = 89_478_485  # PIL's own Image.MAX_IMAGE_PIXELS default (~ 9459 x 9459)
# The decoders `load_image` lets PIL try: the formats image datasets use. Anything else (EPS, which
# PIL renders by running Ghostscript; formats that PIL identifies by heuristics, such as TGA, so
# that random bytes can "decode") is a `corrupt_image` skip ("cannot identify image file").
IMAGE_FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF", "PPM")
_OPEN_FORMATS: list[str] = []


def _open_formats() -> list[str]:
    """IMAGE_FORMATS that this PIL build can open (PIL registers its plugins lazily)."""
    if not _OPEN_FORMATS:
        Image.init()
        _OPEN_FORMATS.extend(f for f in IMAGE_FORMATS if f in Image.OPEN)
    return _OPEN_FORMATS


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert any PIL image to 8-bit RGB, keeping every decodable mode.

    L/1 -> replicated gray; LA/RGBA/PA and P with transparency -> alpha-composited on white;
    CMYK/YCbCr/LAB/HSV -> PIL's conversion; I;16* (16-bit, or mode I with values > 255) -> divided
    by 257; other I / F -> clipped to 0..255 (NaN -> 0, +-inf -> 255 / 0).
    """
    mode = image.mode
    if mode == "RGB":
        return image
    if mode.startswith("I;16") or mode in ("I", "F"):
        array = np.nan_to_num(np.asarray(image).astype(np.float64), nan=0.0, posinf=255.0 * 257, neginf=0.0)
        if mode.startswith("I;16") or (mode == "I" and array.max(initial=0) > 255):
            array = array / 257.0  # 16-bit data (PIL opens some 16-bit files as mode "I")
        array = np.clip(np.rint(array), 0, 255).astype(np.uint8)
        return Image.fromarray(array, mode="L").convert("RGB")
    if mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
        mode = image.mode
    if mode == "La":  # premultiplied: PIL converts it to LA only
        image = image.convert("LA")
    if mode in ("LA", "PA", "RGBa", "La"):
        image = image.convert("RGBA")
        mode = "RGBA"
    if mode == "RGBA":
        background = Image.new("RGB", image.size, (255, 255, 255))
        background.paste(image, mask=image.getchannel("A"))
        return background
    return image.convert("RGB")  # L, 1, CMYK, YCbCr, LAB, HSV


def load_image(source, max_pixels: int = DEFAULT_MAX_PIXELS, sample_id: str = "?"):
    """Open a path or raw bytes as RGB; return the image or a Skip (never raises on bad data).

    Skip reasons: `missing_image`; `corrupt_image` (empty file, not an image, truncated, 0 pixels,
    a format outside `IMAGE_FORMATS`); `image_too_large` (width x height > `max_pixels`, read from
    the header, so a decompression bomb never allocates its pixels).
    """
    if isinstance(source, (str, os.PathLike)):
        if not os.path.isfile(source):
            return Skip("missing_image", sample_id, str(source))
        opener = lambda: Image.open(source, formats=_open_formats())
    else:
        opener = lambda: Image.open(io.BytesIO(source), formats=_open_formats())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = opener()
        try:
            width, height = image.size  # header only, nothing decoded yet
            if width < 1 or height < 1:
                return Skip("corrupt_image", sample_id, f"empty image ({width}x{height})")
            if width * height > max_pixels:
                return Skip("image_too_large", sample_id, f"{width}x{height} > {max_pixels} pixels")
            image.load()
            rgb = to_rgb(image)
            return rgb.copy() if rgb is image else rgb  # close() below frees `image`
        finally:
            image.close()
    except Image.DecompressionBombError as err:
        return Skip("image_too_large", sample_id, str(err))
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as err:
        return Skip("corrupt_image", sample_id, f"{type(err).__name__}: {err}")


RESAMPLE_MODES = {"bicubic": transforms.InterpolationMode.BICUBIC,
                  "nearest": transforms.InterpolationMode.NEAREST,
                  "bilinear": transforms.InterpolationMode.BILINEAR}
IMAGE_ASPECTS = ("resize", "pad")  # squash to the square, or pad to a square first (LLaVA-1.5)


def pad_to_square(image: Image.Image, fill: tuple[int, int, int]) -> Image.Image:
    """An RGB image centred on a square canvas of its longer side filled with ``fill`` (LLaVA's expand2square)."""
    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    canvas = Image.new("RGB", (side, side), fill)
    canvas.paste(image, ((side - width) // 2, (side - height) // 2))
    return canvas


class ImageTransform:
    """PIL image (any mode) -> normalised Float[3, image_size, image_size].

    to_rgb -> [image_aspect="pad": pad_to_square with the mean colour, int(255 * mean)] ->
    Resize((image_size, image_size), resample, antialias) -> ToTensor -> Normalize(mean, std).
    A plain picklable class, so DataLoader workers can use it; `settings()` is what a processor saves.
    """

    def __init__(self, image_size: int = 224, image_mean=(0.5, 0.5, 0.5),
                 image_std=(0.5, 0.5, 0.5), resample: str = "bicubic", image_aspect: str = "resize"):
        if resample not in RESAMPLE_MODES:
            raise ValueError(f"resample must be one of {sorted(RESAMPLE_MODES)}, got {resample!r}")
        if image_aspect not in IMAGE_ASPECTS:
            raise ValueError(f"image_aspect must be one of {list(IMAGE_ASPECTS)}, got {image_aspect!r}")
        self.image_size, self.resample, self.image_aspect = int(image_size), resample, image_aspect
        self.image_mean, self.image_std = list(image_mean), list(image_std)
        self.pad_fill = tuple(int(255 * m) for m in self.image_mean)
        self.transform = transforms.Compose([
            transforms.Resize((self.image_size, self.image_size), interpolation=RESAMPLE_MODES[resample],
                              antialias=True),
            transforms.ToTensor(),
            transforms.Normalize(self.image_mean, self.image_std),
        ])

    def settings(self) -> dict:
        """The constructor arguments: ``ImageTransform(**t.settings())`` is the same transform."""
        return {"image_size": self.image_size, "image_mean": list(self.image_mean),
                "image_std": list(self.image_std), "resample": self.resample, "image_aspect": self.image_aspect}

    def __call__(self, image: Image.Image):
        image = to_rgb(image)
        if self.image_aspect == "pad":
            image = pad_to_square(image, self.pad_fill)
        return self.transform(image)

    def __eq__(self, other) -> bool:
        return isinstance(other, ImageTransform) and self.settings() == other.settings()

    __hash__ = None

    def __repr__(self) -> str:
        return (f"ImageTransform(image_size={self.image_size}, resample={self.resample!r}, "
                f"aspect={self.image_aspect!r}, mean={self.image_mean}, std={self.image_std})")
