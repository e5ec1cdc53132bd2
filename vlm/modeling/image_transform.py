"""Safe image loading (`load_image`, `to_rgb`) and `ImageTransform`, the model's image preprocessing.

`load_image` returns a PIL RGB image or a `Skip` (`missing_image`, `corrupt_image`, `image_too_large`:
the pixel limit is checked on the header, before decoding); `to_rgb` maps every PIL mode to 8-bit RGB.
`ImageTransform` is built by the vision backbone (`VisionEncoder.image_transform()`); its `views`
gives the vision tower's inputs for one picture (one view, or with `anyres` a thumbnail + tiles).
"""

from __future__ import annotations

import io
import math
import os
import warnings

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torchvision import transforms

from .chat_common import Skip

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
# resize: squash to the square; pad: pad to a square first (LLaVA-1.5); anyres: a padded thumbnail
# + the tiles of the best grid (LLaVA-NeXT), a variable number of views per picture
IMAGE_ASPECTS = ("resize", "pad", "anyres")
# anyres grids as [cols, rows] in units of the tower's square side S: LLaVA-NeXT's pinpoints
# (336x672, 672x336, 672x672, 1008x336, 336x1008 as height x width) in the same order
ANYRES_GRIDS = ((2, 1), (1, 2), (2, 2), (3, 1), (1, 3))


def pad_to_square(image: Image.Image, fill: tuple[int, int, int]) -> Image.Image:
    """An RGB image centred on a square canvas of its longer side filled with ``fill`` (LLaVA's expand2square)."""
    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    canvas = Image.new("RGB", (side, side), fill)
    canvas.paste(image, ((side - width) // 2, (side - height) // 2))
    return canvas


def check_grids(grids) -> tuple[tuple[int, int], ...]:
    """``grids`` as a tuple of (cols, rows) pairs of positive ints, non-empty, no repeats (else ValueError)."""
    out = []
    for grid in grids:
        if (not isinstance(grid, (list, tuple)) or len(grid) != 2
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in grid)):
            raise ValueError(f"anyres_grids entries must be [cols, rows] of positive ints, got {grid!r}")
        if tuple(grid) in out:
            raise ValueError(f"anyres_grids repeats {list(grid)}")
        out.append(tuple(grid))
    if not out:
        raise ValueError("anyres_grids must name at least one [cols, rows] grid")
    return tuple(out)


def best_grid(width: int, height: int, grids, side: int) -> tuple[int, int]:
    """The (cols, rows) whose canvas (cols*side x rows*side) shows a width x height image best.

    LLaVA-NeXT's select_best_resolution, same arithmetic and tie order: the largest effective
    resolution (pixels after a fit-inside downscale, at most the original's), then the least waste.
    """
    best, best_effective, best_wasted = None, 0, float("inf")
    for cols, rows in grids:
        canvas_w, canvas_h = cols * side, rows * side
        scale = min(canvas_w / width, canvas_h / height)
        fit_w, fit_h = int(width * scale), int(height * scale)
        effective = min(fit_w * fit_h, width * height)
        wasted = canvas_w * canvas_h - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (cols, rows), effective, wasted
    return best


def fit_size(width: int, height: int, canvas_w: int, canvas_h: int) -> tuple[int, int]:
    """(w, h) of the image resized to fit the canvas keeping its aspect (LLaVA-NeXT's get_patch_output_size)."""
    scale_w, scale_h = canvas_w / width, canvas_h / height
    if scale_w < scale_h:
        return canvas_w, min(math.ceil(height * scale_w), canvas_h)
    return min(math.ceil(width * scale_h), canvas_w), canvas_h


def split_tiles(canvas_CHW: torch.Tensor, side: int) -> torch.Tensor:
    """Float[C, rows*side, cols*side] -> Float[rows*cols, C, side, side], tiles in raster order."""
    channels, height, width = canvas_CHW.shape
    rows, cols = height // side, width // side
    return (canvas_CHW.reshape(channels, rows, side, cols, side).permute(1, 3, 0, 2, 4)
            .reshape(rows * cols, channels, side, side))


class ImageTransform:
    """PIL image (any mode) -> normalised Float[3, image_size, image_size] (``views``: Float[k, 3, S, S]).

    to_rgb -> [image_aspect="pad": pad_to_square with the mean colour, int(255 * mean)] ->
    Resize((image_size, image_size), resample, antialias) -> ToTensor -> Normalize(mean, std).
    image_aspect="anyres": ``views`` gives the "pad" image (the thumbnail) followed by the tiles of
    the best grid of ``anyres_grids`` (see ``anyres_canvas``); ``num_views`` knows k from the size.
    A plain picklable class, so DataLoader workers can use it; `settings()` is what a processor saves.
    """

    def __init__(self, image_size: int = 224, image_mean=(0.5, 0.5, 0.5),
                 image_std=(0.5, 0.5, 0.5), resample: str = "bicubic", image_aspect: str = "resize",
                 anyres_grids=ANYRES_GRIDS):
        if resample not in RESAMPLE_MODES:
            raise ValueError(f"resample must be one of {sorted(RESAMPLE_MODES)}, got {resample!r}")
        if image_aspect not in IMAGE_ASPECTS:
            raise ValueError(f"image_aspect must be one of {list(IMAGE_ASPECTS)}, got {image_aspect!r}")
        self.image_size, self.resample, self.image_aspect = int(image_size), resample, image_aspect
        self.anyres_grids = check_grids(anyres_grids)
        self.image_mean, self.image_std = list(image_mean), list(image_std)
        self.pad_fill = tuple(int(255 * m) for m in self.image_mean)
        self.to_tensor = transforms.Compose([transforms.ToTensor(), transforms.Normalize(self.image_mean, self.image_std)])
        self.transform = transforms.Compose([
            transforms.Resize((self.image_size, self.image_size), interpolation=RESAMPLE_MODES[resample],
                              antialias=True),
            self.to_tensor,
        ])

    def settings(self) -> dict:
        """The constructor arguments: ``ImageTransform(**t.settings())`` is the same transform.

        ``anyres_grids`` is there only with image_aspect="anyres" (the only mode that reads it)."""
        out = {"image_size": self.image_size, "image_mean": list(self.image_mean),
               "image_std": list(self.image_std), "resample": self.resample, "image_aspect": self.image_aspect}
        if self.image_aspect == "anyres":
            out["anyres_grids"] = [list(grid) for grid in self.anyres_grids]
        return out

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """The anyres (cols, rows) for a width x height picture."""
        return best_grid(width, height, self.anyres_grids, self.image_size)

    def num_views(self, width: int, height: int) -> int:
        """Views (vision-tower inputs) of a width x height picture: 1, or 1 + cols * rows with anyres."""
        if self.image_aspect != "anyres":
            return 1
        cols, rows = self.grid(width, height)
        return 1 + cols * rows

    def __call__(self, image: Image.Image):
        if self.image_aspect == "anyres":
            raise ValueError("image_aspect 'anyres' gives several views per image: use views(image)")
        return self._square(to_rgb(image), pad=self.image_aspect == "pad")

    def _square(self, image: Image.Image, pad: bool):
        if pad:
            image = pad_to_square(image, self.pad_fill)
        return self.transform(image)

    def anyres_canvas(self, image: Image.Image):
        """Float[3, rows*S, cols*S]: the image resized to fit the best grid's canvas keeping its
        aspect, centred on the mean colour (LLaVA-NeXT's resize + pad for patching), normalised."""
        image = to_rgb(image)
        cols, rows = self.grid(*image.size)
        canvas_w, canvas_h = cols * self.image_size, rows * self.image_size
        fit_w, fit_h = fit_size(*image.size, canvas_w, canvas_h)
        resized = transforms.functional.resize(image, [fit_h, fit_w], interpolation=RESAMPLE_MODES[self.resample],
                                               antialias=True)
        canvas = Image.new("RGB", (canvas_w, canvas_h), self.pad_fill)
        canvas.paste(resized, ((canvas_w - fit_w) // 2, (canvas_h - fit_h) // 2))
        return self.to_tensor(canvas)

    def views(self, image: Image.Image):
        """Float[k, 3, S, S], k = ``num_views(*image.size)``: the one view, or the thumbnail + tiles."""
        image = to_rgb(image)
        if self.image_aspect != "anyres":
            return self._square(image, pad=self.image_aspect == "pad")[None]
        thumbnail_CHW = self._square(image, pad=True)
        tiles_K3SS = split_tiles(self.anyres_canvas(image), self.image_size)
        return torch.cat([thumbnail_CHW[None], tiles_K3SS])

    def __eq__(self, other) -> bool:
        return isinstance(other, ImageTransform) and self.settings() == other.settings()

    __hash__ = None

    def __repr__(self) -> str:
        grids = f", grids={[list(g) for g in self.anyres_grids]}" if self.image_aspect == "anyres" else ""
        return (f"ImageTransform(image_size={self.image_size}, resample={self.resample!r}, "
                f"aspect={self.image_aspect!r}{grids}, mean={self.image_mean}, std={self.image_std})")
