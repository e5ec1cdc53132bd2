"""Images of a chat request: ``image_url`` parts as ``data:`` URLs (base64) or, when the operator names an
``--image-root``, files under it (``file://`` URLs or paths relative to the root). Remote URLs are refused
(the server does not fetch: the machine may be offline, and fetching on a client's behalf is a risk).
Error messages never echo a path outside the root."""
from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from urllib.parse import unquote, urlparse

from PIL import Image

from .request import EngineError


def _bad(message: str) -> EngineError:
    return EngineError(message, 400, "invalid_image", "messages")


def _open(data: bytes, max_pixels: int) -> Image.Image:
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height > max_pixels:
                raise _bad(f"image of {img.width}x{img.height} pixels exceeds the limit of {max_pixels} pixels")
            return img.convert("RGB")
    except EngineError:
        raise
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise _bad(f"the image could not be decoded ({type(e).__name__})") from None


def under_root(root: Path, ref: str) -> Path:
    """The file ``ref`` names under ``root``: no ``..`` component, and resolved (symlinks followed)
    still inside the root; else an error that names neither the path nor the root."""
    rel = Path(ref)
    if ".." in rel.parts:
        raise _bad("image paths may not contain '..'")
    root = root.resolve()
    path = (root / rel).resolve() if not rel.is_absolute() else rel.resolve()
    if not path.is_relative_to(root):
        raise _bad("the image path is outside the server's --image-root")
    if not path.is_file():
        raise _bad("no such image file under the server's --image-root")
    return path


def load_image(url: str, image_root: Path | None, max_bytes: int, max_pixels: int) -> Image.Image:
    """The RGB image an ``image_url`` names (see the module docstring)."""
    if not isinstance(url, str) or not url:
        raise _bad("image_url.url must be a non-empty string")
    scheme = urlparse(url).scheme.lower()
    if scheme == "data":
        head, _, payload = url.partition(",")
        if ";base64" not in head:
            raise _bad("data: image URLs must be base64 (data:image/png;base64,...)")
        if len(payload) > max_bytes * 4 // 3 + 4:
            raise _bad(f"the image is larger than the limit of {max_bytes} bytes")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise _bad("the data: URL is not valid base64") from None
        return _open(data, max_pixels)
    if scheme in ("http", "https", "ftp"):
        raise _bad("remote image URLs are not fetched by this server (offline): send the image as a "
                   "data: URL (base64), or a file under the server's --image-root")
    if scheme not in ("", "file"):
        raise _bad(f"unsupported image URL scheme {scheme!r}: use data: or a file under --image-root")
    if image_root is None:
        raise _bad("local image files are refused: the server was started without --image-root")
    ref = unquote(urlparse(url).path) if scheme == "file" else url
    path = under_root(image_root, ref)
    if path.stat().st_size > max_bytes:
        raise _bad(f"the image is larger than the limit of {max_bytes} bytes")
    return _open(path.read_bytes(), max_pixels)
