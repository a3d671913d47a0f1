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
- DECODE_SLOTS (default 2, or 1 on a 2-core machine; the app's VLM_DECODE_SLOTS, read in its main()):
  images decoded at once, whichever request or handler asks; the others wait their turn, holding no pixels. With `fit` (the
  model's processor), an image is reduced as it is decoded (JPEG: libjpeg's 1/2, 1/4, 1/8 scale)
  or at once after (an integer box reduction), to no less than what the processor uses, so its
  full-resolution pixels are never kept past the slot.
- FORMATS: the only formats opened (Pillow's plugins for every other one are never called: ICO
  and ICNS decode their largest entry while opening, before any header check, and it may be far
  larger than their header says: a 0.69 MB ICO holding a 13000x13000 PNG took +647 MB). A file
  in another format Pillow knows is refused by that format's name, from its first bytes.
- Pillow's own bomb check (`Image.MAX_IMAGE_PIXELS`) is set to MAX_PIXELS, for every image this
  process opens; its warning (over MAX_PIXELS, under twice that) is silenced, as load_image
  refuses those images by their header with their size.
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
import threading
import warnings

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageMode, ImageOps, UnidentifiedImageError

from engine.settings import setting

MAX_FILE_BYTES = 20 * 1024 * 1024
MAX_PIXELS = 40_000_000
MAX_DECODED_BYTES = 4 * MAX_PIXELS  # 40 megapixels of the heaviest modes (float, RGBA, CMYK: 4 bytes a pixel)


def default_decode_slots() -> int:
    """Two at most, and one core left for the server's event loop (a 2-core Space decodes one at a time)."""
    return max(1, min(2, (os.cpu_count() or 2) - 1))


# Images decoded at once by load_image, whoever asks; sized from the CPUs here (nothing is read from the
# environment at import): the app sizes it from VLM_DECODE_SLOTS in its main() (`use_decode_slots`).
DECODE_SLOTS = threading.BoundedSemaphore(default_decode_slots())
# Modes Image.reduce cannot take, and the mode each is reduced in instead.
REDUCIBLE_AS = {"1": "L", "P": "RGBA", "PA": "RGBA", "I;16": "I", "I;16L": "I", "I;16B": "I", "I;16N": "I"}
EXIF_ORIENTATION = 0x0112
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # JPEG includes MPO: Pillow opens it through JPEG's factory
FORMAT_NAMES = "PNG, JPEG, WebP, GIF, BMP and TIFF"
Image.MAX_IMAGE_PIXELS = MAX_PIXELS  # over twice this, Pillow refuses while opening (DecompressionBombError)
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)  # over once: check_header refuses it


@dataclass(frozen=True)
class Decoding:
    """The app's bound on decoding (docs/security.md), read by engine/settings.py `from_environ`."""

    decode_slots: int | None = setting(None, "images decoded at once, all requests together (default 2, or 1 on "
                                       "a 2-core machine)", low=0, env="VLM_DECODE_SLOTS")

    def slots(self) -> int:
        return default_decode_slots() if self.decode_slots is None else max(1, self.decode_slots)


def use_decode_slots(slots: int) -> threading.BoundedSemaphore:
    """Decode at most `slots` images at once from now on, whoever calls load_image without its
    own `slots` (the app's main(), from VLM_DECODE_SLOTS: `Decoding`)."""
    global DECODE_SLOTS
    DECODE_SLOTS = threading.BoundedSemaphore(slots)
    return DECODE_SLOTS


class ImageError(ValueError):
    """A file that cannot be used as an image; the message names it and the problem."""


def load_image(source, name: str | None = None, max_bytes: int = MAX_FILE_BYTES,
               max_pixels: int = MAX_PIXELS, fit=None, max_decoded_bytes: int = MAX_DECODED_BYTES,
               family=None, slots: threading.Semaphore | None = None) -> Image.Image:
    """source: a path, raw bytes, or a PIL image. Returns a fully decoded RGB image; with `fit`
    (a VLM processor, or its image processor), the image as `fit_to_processor` makes it, decoded
    under DECODE_SLOTS and reduced as it is decoded (see the module docstring); `family`: the
    model's Family (models/families), for its own resize rule; `slots`: the decode slots to wait
    for (default DECODE_SLOTS, shared by every caller)."""
    if isinstance(source, Image.Image):
        return to_rgb(source) if fit is None else fit_to_processor(to_rgb(source), fit, family)
    name = name or (os.path.basename(source) if isinstance(source, (str, os.PathLike)) else "image")
    file = _open(source, name, max_bytes)  # a path stays on disk while the request waits for a slot
    try:
        with Image.open(file, formats=FORMATS) as image:
            check_header(image, name, max_pixels, max_decoded_bytes)
            with slots or DECODE_SLOTS:
                try:
                    image.seek(0)  # animated images: the first frame
                    return _decode(image, fit, family)
                finally:
                    image.close()  # the full-resolution pixels go before the slot does
                    _return_freed_memory()
    except Exception as error:
        _return_freed_memory()  # what a refused file made a decoder allocate
        raise _named(error, name, max_pixels, file) from None
    finally:
        file.close()


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
        return ImageError(f"{name}: too large to decode on this server; send a smaller image")
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


def _decode(image: Image.Image, fit, family=None) -> Image.Image:
    """`image` decoded; with `fit`, reduced while decoding (JPEG) or right after, to no less than
    the processor's size, then made exactly that size."""
    target = None if fit is None else _fit_size(*_upright_size(image), fit, family)
    if target is not None:
        if _rotated(image):
            target = target[::-1]
        image.draft(image.mode, target)  # JPEG: decode at 1/2, 1/4 or 1/8 scale, still at least `target`
    image.load()
    if target is not None:
        factor = min(image.size[0] // target[0], image.size[1] // target[1])
        if factor >= 2:
            reducible = image if image.mode not in REDUCIBLE_AS else image.convert(REDUCIBLE_AS[image.mode])
            image = _keep_exif(reducible.reduce(factor), image)
    image = to_rgb(image)
    return image if fit is None else fit_to_processor(image, fit, family)


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
    images = getattr(processor, "image_processor", processor)
    new_size = _fit_size(*image.size, processor, family)
    if new_size is None:
        return image
    return image.resize(new_size, Image.Resampling(int(getattr(images, "resample", None) or Image.Resampling.BICUBIC)))


def _fit_size(width: int, height: int, processor, family=None) -> tuple[int, int] | None:
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
