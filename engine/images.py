"""Opening user images safely: every accepted file becomes an RGB PIL image, every refused
one raises ImageError with the file's name and the reason.

Limits (configurable through the arguments; the app and CLI use the defaults):
- MAX_FILE_BYTES: files larger than this are refused before decoding (the app also gives it to
  Gradio as `max_file_size`, so a larger upload never reaches the server's disk).
- MAX_PIXELS: width * height above this is refused from the header alone, before any pixel is
  decoded: a decompression bomb (a 20000x20000 one-colour PNG is 50 KB on disk and 400 MB
  decoded) never allocates its pixels. 40 megapixels covers any camera photo.
- MAX_DECODED_BYTES: the decoded size, from the header too, mode and bit depth included (a
  float TIFF holds 4 bytes a pixel, a 16-bit one 2, RGB 3).
- Where: a file a visitor sent is decoded only in a jailed child process (engine/image_jail.py:
  a pool of `VLM_DECODE_SLOTS` children under an address-space, a CPU and a wall-clock limit),
  which runs `decode_file` and hands back the pixels; `load_image` runs the same code in this
  process, for files the program itself owns (tests, fixtures). With `fit` (the model's
  processor), an image is reduced as it is decoded (JPEG: libjpeg's 1/2, 1/4, 1/8 scale) or at
  once after (an integer box reduction), to no less than what the processor uses, so its
  full-resolution pixels are never kept.
- FORMATS: the only formats opened (Pillow's plugins for every other one are never called: ICO
  and ICNS decode their largest entry while opening, before any header check, and it may be far
  larger than their header says: a 0.69 MB ICO holding a 13000x13000 PNG took +647 MB). A file
  in another format Pillow knows is refused by that format's name, from its first bytes.
- Pillow's own bomb check (`Image.MAX_IMAGE_PIXELS`) is left as Pillow sets it here; the jail's
  child sets it to MAX_PIXELS and silences its warning (`use_pixel_bound`), as check_header
  refuses those images by their header with their size. Nothing here changes global state at import.
Every failure of a decoder is an ImageError (one line, the file's name and the decoder's words),
and the memory a refused file made the decoder allocate is handed back as a decoded one's is.
Handled rather than refused: animated images (first frame), CMYK, 16-bit and 32-bit
grayscale, palette and transparent images (composited on white), EXIF rotation.

`fit_to_processor` shrinks an image to the size the model's processor would resize it to, so a
conversation keeps a few hundred kilobytes per photo instead of its full resolution.
"""

from __future__ import annotations

import io
import math
import os
import warnings
from collections.abc import Callable

import numpy as np
from PIL import Image, ImageMode, ImageOps, UnidentifiedImageError

MAX_FILE_BYTES = 20 * 1024 * 1024
MAX_PIXELS = 40_000_000
MAX_DECODED_BYTES = 4 * MAX_PIXELS  # 40 megapixels of the heaviest modes (float, RGBA, CMYK: 4 bytes a pixel)


# Modes Image.reduce cannot take, and the mode each is reduced in instead.
REDUCIBLE_AS = {"1": "L", "P": "RGBA", "PA": "RGBA", "I;16": "I", "I;16L": "I", "I;16B": "I", "I;16N": "I"}
EXIF_ORIENTATION = 0x0112
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # JPEG includes MPO: Pillow opens it through JPEG's factory
FORMAT_NAMES = "PNG, JPEG, WebP, GIF, BMP and TIFF"
# What the processor makes of an upright width x height image (the size to reduce to; None: kept as it is).
TargetFor = Callable[[int, int], "tuple[int, int] | None"]


class ImageError(ValueError):
    """A file that cannot be used as an image; the message names it and the problem."""


class TooLarge(ImageError):
    """Decoding the file ran out of memory (in the jail's child: its address-space limit)."""


def use_pixel_bound(max_pixels: int = MAX_PIXELS) -> None:
    """Pillow's own bomb check (DecompressionBombError while opening, over twice `max_pixels`) for
    every image this process opens, its warning (over once) silenced: check_header refuses those
    by their header. Global to the process: the jail's child calls it (engine/image_child.py)."""
    Image.MAX_IMAGE_PIXELS = max_pixels
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def load_image(source, name: str | None = None, max_bytes: int = MAX_FILE_BYTES,
               max_pixels: int = MAX_PIXELS, fit=None, max_decoded_bytes: int = MAX_DECODED_BYTES,
               family=None) -> Image.Image:
    """source: a path, raw bytes, or a PIL image. Returns a fully decoded RGB image; with `fit`
    (a VLM processor, or its image processor), the image as `fit_to_processor` makes it, reduced
    as it is decoded (see the module docstring); `family`: the model's Family (models/families),
    for its own resize rule. Decodes in this process: for files the program owns. A visitor's
    file goes through engine/image_jail.py `ImageJail.load`, which runs `decode_file` in a child."""
    if isinstance(source, Image.Image):
        return to_rgb(source) if fit is None else fit_to_processor(to_rgb(source), fit, family)
    name = name or (os.path.basename(source) if isinstance(source, (str, os.PathLike)) else "image")
    def target_for(width: int, height: int) -> tuple[int, int] | None:
        try:
            return fit_size(width, height, fit, family)
        except Exception as error:  # e.g. Qwen-VL's over 200:1
            raise shape_refused(name, width, height, error) from None

    return decode_file(source, name, max_bytes, max_pixels, max_decoded_bytes, None if fit is None else target_for,
                       Image.Resampling(resample_of(fit)))


def shape_refused(name: str, width: int, height: int, error: Exception) -> ImageError:
    """The refusal of an image whose size (from its header) the model's processor would refuse
    (`fit_size` raised `error`), one line, before it is decoded."""
    words = " ".join(str(error).split())[:160]
    return ImageError(f"{name}: {width}x{height} is a shape this model's processor does not take ({words}); "
                      "send it cropped")


def decode_file(source, name: str, max_bytes: int = MAX_FILE_BYTES, max_pixels: int = MAX_PIXELS,
                max_decoded_bytes: int = MAX_DECODED_BYTES, target_for: TargetFor | None = None,
                resample: Image.Resampling = Image.Resampling.BICUBIC) -> Image.Image:
    """`source` (a path or bytes) decoded to RGB; `target_for(width, height)`: the size the model
    takes an upright image of that size at (None: as it is), asked once the header is read; the
    image is reduced while decoding, then resized to it with `resample`. ImageError names the
    file and the problem."""
    file = _open(source, name, max_bytes)
    try:
        with Image.open(file, formats=FORMATS) as image:
            check_header(image, name, max_pixels, max_decoded_bytes)
            try:
                image.seek(0)  # animated images: the first frame
                target = None if target_for is None else target_for(*_upright_size(image))
                return _decode(image, target, resample)
            finally:
                image.close()  # the full-resolution pixels go at once
                _return_freed_memory()
    except Exception as error:
        _return_freed_memory()  # what a refused file made a decoder allocate
        raise _named(error, name, max_pixels, file) from None
    finally:
        file.close()


def resample_of(processor) -> int:
    """The resampling filter `processor` (a VLM processor, or its image processor) resizes with."""
    images = getattr(processor, "image_processor", processor)
    return int(getattr(images, "resample", None) or Image.Resampling.BICUBIC)


def _named(error: Exception, name: str, max_pixels: int, file) -> ImageError:
    """The ImageError, one line naming the file, for whatever opening or decoding it raised."""
    if isinstance(error, ImageError):
        return error
    if isinstance(error, UnidentifiedImageError):
        known = _format_of(file, name)
        return ImageError(f"{name}: {known} is an image format this app does not read ({FORMAT_NAMES} work); "
                          "convert it" if known else
                          f"{name}: not an image file, or a format this app cannot read ({FORMAT_NAMES} work)")
    if isinstance(error, Image.DecompressionBombError):  # Pillow's limit, checked while opening: twice ours
        return ImageError(f"{name}: far more than {max_pixels:,} pixels (a likely decompression bomb); resize it "
                          "and send it again")
    if isinstance(error, MemoryError):
        return TooLarge(f"{name}: too large to decode on this server; send a smaller image")
    words = " ".join(str(error).split())[:120]
    return ImageError(f"{name}: damaged or truncated image ({type(error).__name__}{': ' + words if words else ''})")


def _format_of(file, name: str) -> str | None:
    """The format outside FORMATS that Pillow knows `file` as, never by opening it: the one its
    name's extension says, else the first whose signature check passes on its first 16 bytes (as
    Image.open reads them): "ICO (Windows Icon)"; None if none (one of FORMATS that failed to
    open: damaged, or not an image)."""
    by_extension = Image.registered_extensions().get(os.path.splitext(name)[1].lower())
    if by_extension in Image.OPEN and by_extension not in FORMATS:  # one it reads (PDF: Pillow only writes)
        return _described(by_extension)
    file.seek(0)
    prefix = file.read(16)
    for format in Image.ID:
        accept = Image.OPEN.get(format, (None, None))[1]
        try:
            if format not in FORMATS and accept is not None and accept(prefix):
                return _described(format)
        except Exception:  # a signature check that fails on a short prefix: not that format
            continue
    return None


def _described(format: str) -> str:
    factory = Image.OPEN.get(format, (None,))[0]
    return f"{format} ({getattr(factory, 'format_description', None) or format})"


def _return_freed_memory() -> None:
    """Hand the heap memory a decode freed back to the system (glibc keeps freed blocks of
    Pillow's 16 MB image blocks in per-thread arenas, where other threads cannot reuse them:
    measured, eight visitors' decodes left +2 GB resident a minute later without this)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc():
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc (macOS, musl): nothing to trim
        return None


_LIBC = _glibc()


def decoded_bytes(image: Image.Image) -> int:
    """What `image`'s pixels take once decoded, from its header: width x height x bands x the
    bytes of one band (Pillow keeps a 1-bit image at a byte a pixel)."""
    mode = ImageMode.getmode(image.mode)
    return image.size[0] * image.size[1] * len(mode.bands) * int(mode.typestr[-1])


def check_header(image: Image.Image, name: str, max_pixels: int = MAX_PIXELS,
                 max_decoded_bytes: int = MAX_DECODED_BYTES) -> None:
    """ImageError when `image` (opened, not decoded) is over either bound."""
    width, height = image.size
    if width * height > max_pixels:
        raise ImageError(f"{name}: {width}x{height} is {width * height:,} pixels, over the limit of "
                         f"{max_pixels:,} (a likely decompression bomb); resize it and send it again")
    if decoded_bytes(image) > max_decoded_bytes:
        raise ImageError(f"{name}: {width}x{height} in mode {image.mode} is {decoded_bytes(image) / 1e6:,.0f} MB "
                         f"decoded, over the limit of {max_decoded_bytes / 1e6:,.0f} MB; send it as an 8-bit "
                         "RGB image or smaller")


def _decode(image: Image.Image, target: tuple[int, int] | None, resample: Image.Resampling) -> Image.Image:
    """`image` decoded to RGB; with `target` (its upright size), reduced while decoding (JPEG) or
    right after, to no less than `target`, then made exactly that size."""
    decoded_target = target[::-1] if target is not None and _rotated(image) else target
    if decoded_target is not None:
        image.draft(image.mode, decoded_target)  # JPEG: decode at 1/2, 1/4 or 1/8 scale, still at least the target
    image.load()
    if decoded_target is not None:
        factors = (image.size[0] // decoded_target[0], image.size[1] // decoded_target[1])
        # One factor for both sides; a side alone for a far longer than wide image (40,000,000x1: resizing
        # it in one step took +1.2 GB of Pillow's filter coefficients).
        factor = min(factors) if min(factors) >= 2 else (max(1, factors[0]), max(1, factors[1]))
        if max(factors) >= 2:
            reducible = image if image.mode not in REDUCIBLE_AS else image.convert(REDUCIBLE_AS[image.mode])
            image = _keep_exif(reducible.reduce(factor), image)
    image = to_rgb(image)
    return image if target is None or image.size == tuple(target) else image.resize(tuple(target), resample)


def _upright_size(image: Image.Image) -> tuple[int, int]:
    width, height = image.size
    return (height, width) if _rotated(image) else (width, height)


def _rotated(image: Image.Image) -> bool:
    """EXIF says the image is turned a quarter (orientations 5 to 8)."""
    try:
        return image.getexif().get(EXIF_ORIENTATION) in (5, 6, 7, 8)
    except Exception:  # a damaged EXIF block: to_rgb ignores it too
        return False


def _keep_exif(reduced: Image.Image, original: Image.Image) -> Image.Image:
    """`reduced` with `original`'s EXIF orientation, for to_rgb to apply."""
    orientation = original.getexif().get(EXIF_ORIENTATION)
    if orientation:
        reduced.getexif()[EXIF_ORIENTATION] = orientation
    return reduced


def _open(source, name: str, max_bytes: int):
    """A file object for `source` (a path or bytes), or ImageError naming what is wrong."""
    if isinstance(source, (bytes, bytearray)):
        size, opener = len(source), lambda: io.BytesIO(bytes(source))
    else:
        try:
            size, opener = os.path.getsize(source), lambda: open(source, "rb")
            if os.path.isdir(source):
                raise IsADirectoryError
        except FileNotFoundError:
            raise ImageError(f"{name}: no such file") from None
        except IsADirectoryError:
            raise ImageError(f"{name}: is a folder, not an image file") from None
        except (OSError, TypeError, ValueError):
            raise ImageError(f"{name}: cannot be read") from None
    if size > max_bytes:
        raise ImageError(f"{name}: {size / 1e6:.1f} MB is over the upload limit of {max_bytes / 1e6:.0f} MB")
    if not size:
        raise ImageError(f"{name}: the file is empty")
    try:
        return opener()
    except PermissionError:
        raise ImageError(f"{name}: cannot be read (permission denied)") from None
    except OSError as error:
        raise ImageError(f"{name}: cannot be read ({error.strerror or error})") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """EXIF rotation applied; any mode converted to 8-bit RGB (transparency on white)."""
    image = ImageOps.exif_transpose(image)
    if image.mode.startswith("I") or image.mode == "F":  # 16/32-bit or float grayscale: scale to 8 bits
        values = np.asarray(image)  # uint16, int32 or float32: 2 or 4 bytes a pixel, never 8
        full_scale = 65535 if values.max(initial=0) > 255 else 255
        scaled = values.clip(0, full_scale).astype(np.float32)
        scaled *= np.float32(255 / full_scale)
        image = Image.fromarray(scaled.round(out=scaled).astype(np.uint8), "L")
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
    bit-for-bit the same as for the full image; Step-3.7 keeps the full resolution for its
    local crops); else processors that resize to a longest or shortest edge, or to a fixed
    height and width, get the largest image that still covers it."""
    new_size = fit_size(*image.size, processor, family)
    if new_size is None:
        return image
    return image.resize(new_size, Image.Resampling(resample_of(processor)))


def fit_size(width: int, height: int, processor, family=None) -> tuple[int, int] | None:
    """The size fit_to_processor shrinks a `width` x `height` image to; None: kept as it is."""
    images = getattr(processor, "image_processor", processor)
    size = _size_dict(getattr(images, "size", None))
    if getattr(images, "do_pan_and_scan", False) or getattr(images, "image_grid_pinpoints", None) \
            or not getattr(images, "do_resize", True) or not size:
        return None
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
        return None
    if new_size is None or new_size[0] * new_size[1] >= width * height:
        return None
    return new_size


def _size_dict(size) -> dict:
    if size is None:
        return {}
    items = size.items() if isinstance(size, dict) else vars(size).items()
    return {key: value for key, value in items if isinstance(value, (int, float)) and value > 0}


def _scaled(width: int, height: int, scale: float) -> tuple[int, int] | None:
    if scale >= 1:
        return None
    return max(1, math.ceil(width * scale)), max(1, math.ceil(height * scale))
