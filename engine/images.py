"""Opening user images safely: every accepted file becomes an RGB PIL image, every refused
one raises ImageError with the file's name and the reason.

Limits (configurable through the arguments; the app and CLI use the defaults):
- MAX_FILE_BYTES: files larger than this are refused before decoding (the app also gives it to
  Gradio as `max_file_size`, so a larger upload never reaches the server's disk).
- MAX_PIXELS: width * height above this is refused from the header alone, before any pixel is
  decoded: a decompression bomb (a 20000x20000 one-colour PNG is 50 KB on disk and 400 MB
  decoded) never allocates its pixels. 40 megapixels covers any camera photo.
Handled rather than refused: animated images (first frame), CMYK, 16-bit and 32-bit
grayscale, palette and transparent images (composited on white), EXIF rotation.

`fit_to_processor` shrinks an image to the size the model's processor would resize it to, so a
conversation keeps a few hundred kilobytes per photo instead of its full resolution.
"""

from __future__ import annotations

import io
import math
import os

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

MAX_FILE_BYTES = 20 * 1024 * 1024
MAX_PIXELS = 40_000_000


class ImageError(ValueError):
    """A file that cannot be used as an image; the message names it and the problem."""


def load_image(source, name: str | None = None, max_bytes: int = MAX_FILE_BYTES,
               max_pixels: int = MAX_PIXELS) -> Image.Image:
    """source: a path, raw bytes, or a PIL image. Returns a fully decoded RGB image."""
    if isinstance(source, Image.Image):
        return to_rgb(source)
    name = name or (os.path.basename(source) if isinstance(source, (str, os.PathLike)) else "image")
    data = _read(source, name, max_bytes)
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise ImageError(f"{name}: {width}x{height} is {width * height:,} pixels, over the limit of "
                                 f"{max_pixels:,} (a likely decompression bomb); resize it and send it again")
            image.seek(0)  # animated images: the first frame
            image.load()
            return to_rgb(image)
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(f"{name}: not an image file, or a format this app cannot read "
                         "(PNG, JPEG, WebP, GIF, BMP and TIFF work)") from None
    except Image.DecompressionBombError:  # Pillow's own limit, checked while opening: far over ours
        raise ImageError(f"{name}: far more than {max_pixels:,} pixels (a likely decompression bomb); "
                         "resize it and send it again") from None
    except (OSError, SyntaxError, ValueError) as error:
        raise ImageError(f"{name}: damaged or truncated image ({error})") from None


def _read(source, name: str, max_bytes: int) -> bytes:
    if isinstance(source, (bytes, bytearray)):
        data = bytes(source)
    else:
        try:
            size = os.path.getsize(source)
            if size > max_bytes:
                raise ImageError(f"{name}: {size / 1e6:.1f} MB is over the upload limit of {max_bytes / 1e6:.0f} MB")
            with open(source, "rb") as file:
                data = file.read()
        except FileNotFoundError:
            raise ImageError(f"{name}: no such file") from None
        except IsADirectoryError:
            raise ImageError(f"{name}: is a folder, not an image file") from None
        except PermissionError:
            raise ImageError(f"{name}: cannot be read (permission denied)") from None
    if len(data) > max_bytes:
        raise ImageError(f"{name}: {len(data) / 1e6:.1f} MB is over the upload limit of {max_bytes / 1e6:.0f} MB")
    if not data:
        raise ImageError(f"{name}: the file is empty")
    return data


def to_rgb(image: Image.Image) -> Image.Image:
    """EXIF rotation applied; any mode converted to 8-bit RGB (transparency on white)."""
    image = ImageOps.exif_transpose(image)
    if image.mode.startswith("I") or image.mode == "F":  # 16/32-bit or float grayscale: scale to 8 bits
        values = np.asarray(image, dtype=np.float64)
        full_scale = 65535.0 if values.max(initial=0) > 255 else 255.0
        image = Image.fromarray((values.clip(0, full_scale) * (255.0 / full_scale)).round().astype(np.uint8), "L")
    if image.mode == "P":
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA"):
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, image.convert("RGBA"))
    return image.convert("RGB")


def fit_to_processor(image: Image.Image, processor, family=None) -> Image.Image:
    """`image` shrunk to what `processor` (a VLM processor, or its image processor) resizes it
    to anyway; never enlarged, and unchanged when it is small enough or the processor crops
    from the full resolution (pan-and-scan, any-resolution grids). Idempotent.

    A `family` (models/families) with a resize rule of its own gives the size
    (`Family.fitted_size`: Qwen-VL's exact `smart_resize`, so the processor's output is
    bit-for-bit the same as for the full image); else processors that resize to a longest or
    shortest edge, or to a fixed height and width, get the largest image that still covers it."""
    images = getattr(processor, "image_processor", processor)
    size = _size_dict(getattr(images, "size", None))
    if getattr(images, "do_pan_and_scan", False) or getattr(images, "image_grid_pinpoints", None) \
            or not getattr(images, "do_resize", True) or not size:
        return image
    width, height = image.size
    family_size = family.fitted_size(images, width, height) if family is not None else None
    if family_size is not None:
        new_size = family_size
    elif size.get("longest_edge"):
        new_size = _scaled(width, height, size["longest_edge"] / max(width, height))
    elif size.get("shortest_edge"):
        new_size = _scaled(width, height, size["shortest_edge"] / min(width, height))
    elif size.get("height") and size.get("width"):
        new_size = _scaled(width, height, max(size["height"] / height, size["width"] / width))
    else:
        return image
    if new_size is None or new_size[0] * new_size[1] >= width * height:
        return image
    return image.resize(new_size, Image.Resampling(int(getattr(images, "resample", None) or Image.Resampling.BICUBIC)))


def _size_dict(size) -> dict:
    if size is None:
        return {}
    items = size.items() if isinstance(size, dict) else vars(size).items()
    return {key: value for key, value in items if isinstance(value, (int, float)) and value > 0}


def _scaled(width: int, height: int, scale: float) -> tuple[int, int] | None:
    if scale >= 1:
        return None
    return max(1, math.ceil(width * scale)), max(1, math.ceil(height * scale))
