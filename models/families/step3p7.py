"""Step-3.7: 1-axis RoPE; each image expands to <im_start> <im_patch>... <im_end> (and local
crops between <patch_start> / <patch_end>). Its checkpoints carry MTP layers
(`num_nextn_predict_layers`), which `--drafter mtp` drafts with (engine/drafters/mtp.py).

Images: a global view plus local crops of the full-resolution image. transformers 5.24 ships
the image processor as a torchvision class only (`Step3p7ImageProcessor`); `Step3p7ImageProcessorPil`
below is the same algorithm on transformers' PIL backend (`PilBackend`: numpy arrays, resizing
with PIL), read from the folder's saved settings and saved under the stock class name.

What was compared (tests/test_image_processors.py):
- Step-3.7: transformers' own `Step3p7ImageProcessor` code (patch planning, square padding,
  global view, local crops, newline masks) run with torch's antialiased resize, as
  torchvision's `resize` runs it for uint8 images on a CPU, against this class on images
  with no crops, with crops, elongated, scaled down and near-degenerate: same shapes, crop
  counts and newline masks; pixel values apart by whole uint8 levels only (at most 2, where
  PIL's and torch's bilinear kernels round differently; the shares are in the test). The
  plan (`step3p7_plan`) equals transformers' `_plan_patches` over thousands of sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_transforms import divide_to_patches
from transformers.image_utils import SizeDict
from transformers.models.step3p7.image_processing_step3p7 import Step3p7ImageProcessor, Step3p7ImageProcessorKwargs

from .base import MARKUP_SPELLINGS, Family

_STEP3P7 = Step3p7ImageProcessor  # transformers' torchvision class: its settings are read below


def step3p7_plan(width: int, height: int, image_size: int, patch_size: int, max_image_size: int) -> tuple:
    """transformers' `Step3p7ImageProcessor._plan_patches`, with `max_image_size` an argument
    (transformers reads it from the instance, so a per-call value is ignored there; the image
    budget passes one). Returns ((width, height) of the global view before squaring,
    (width, height) to resize to before cropping, window side (0: no crops), columns, rows,
    whether to zero-pad the image to a square first)."""
    needs_square_pad = min(width, height) < 32 and max(width / height, height / width) > 4  # near-degenerate
    if needs_square_pad:
        width = height = max(width, height)
    if max(height, width) > max_image_size:
        scale = max_image_size / max(height, width)
        width, height = int(width * scale), int(height * scale)
    short_side, long_side = min(height, width), max(height, width)
    if long_side <= image_size:  # fits the global view: crops only along an elongated image
        window = short_side if long_side / short_side > 1.5 else 0
    elif long_side / short_side > 4:
        window = min(short_side, patch_size)
    else:
        window = patch_size
    if window == 0:
        return (width, height), (width, height), 0, 0, 0, needs_square_pad
    # each side snapped to a multiple of the window, up when the rest exceeds 20 % of it
    crop_width, crop_height = (window * (side // window + (side % window > 0.2 * window)) if side >= window else side
                               for side in (width, height))
    columns, rows = max(1, crop_width // window), max(1, crop_height // window)
    return (width, height), (crop_width, crop_height), window, columns, rows, needs_square_pad


class Step3p7ImageProcessorPil(PilBackend):
    """Step-3.7's images on PIL: a global view of `size` plus local crops of `patch_size`.

    The crop plan is transformers' (`step3p7_plan`): an image larger than `size` (or
    elongated) is cut into windows of `patch_size` pixels, each resized to `patch_size` and
    given `(patch_size / 56)**2` tokens; the whole image, squared, is the global view
    (`(size / 56)**2` tokens). `Step3p7Processor` builds the prompt from `num_local_patches`
    and `patch_newline_masks`.
    """

    # transformers' settings, unchanged
    resample, size, patch_size = _STEP3P7.resample, _STEP3P7.size, _STEP3P7.patch_size
    max_image_size = _STEP3P7.max_image_size
    do_rescale, do_normalize, do_convert_rgb = _STEP3P7.do_rescale, _STEP3P7.do_normalize, _STEP3P7.do_convert_rgb
    image_mean, image_std = _STEP3P7.image_mean, _STEP3P7.image_std
    vision_patch_size, downsampler_stride = _STEP3P7.vision_patch_size, _STEP3P7.downsampler_stride
    valid_kwargs, model_input_names = Step3p7ImageProcessorKwargs, _STEP3P7.model_input_names

    def get_number_of_image_patches(self, height: int, width: int, images_kwargs=None) -> int:
        """The number of local crops of an image of this size."""
        images_kwargs = images_kwargs or {}
        _, _, _, columns, rows, _ = step3p7_plan(
            width, height, images_kwargs.get("size", self.size)["height"],
            images_kwargs.get("patch_size", self.patch_size), images_kwargs.get("max_image_size", self.max_image_size))
        return columns * rows

    def _views(self, image: np.ndarray, image_size: int, patch_size: int, max_image_size: int, resample) -> tuple:
        """`Step3p7ImageProcessor._get_image_patches` on a (3, H, W) uint8 array: the global view
        (3, image_size, image_size), the raw crops (each at most window x window), and the
        crop grid's columns and rows."""
        _, height, width = image.shape
        global_size, crop_size, window, columns, rows, needs_square_pad = step3p7_plan(
            width, height, image_size, patch_size, max_image_size)
        if needs_square_pad:  # the original at the top left, zeros elsewhere
            side = max(width, height)
            image = self.pad([image], pad_size=SizeDict(height=side, width=side))[0]
        global_view = self.resize(image, SizeDict(height=global_size[1], width=global_size[0]), resample=resample)
        global_view = self.resize(global_view, SizeDict(height=image_size, width=image_size), resample=resample)
        if window == 0:
            return global_view, [], columns, rows
        for_crops = self.resize(image, SizeDict(height=crop_size[1], width=crop_size[0]), resample=resample)
        return global_view, divide_to_patches(for_crops, patch_size=window), columns, rows

    def _preprocess(self, images: list[np.ndarray], do_rescale: bool, rescale_factor: float, do_normalize: bool,
                    image_mean, image_std, resample, size: SizeDict, patch_size: int, max_image_size: int,
                    return_tensors=None, **kwargs) -> BatchFeature:
        def scaled(view: np.ndarray) -> np.ndarray:
            view = self.rescale(view, rescale_factor) if do_rescale else view
            return self.normalize(view, image_mean, image_std) if do_normalize else view

        global_views, crops, num_local_patches, newline_masks = [], [], [], []
        for image in images:
            global_view, image_crops, columns, rows = self._views(image, size.height, patch_size, max_image_size,
                                                                  resample)
            global_views.append(scaled(global_view))
            square = SizeDict(height=patch_size, width=patch_size)
            crops += [scaled(self.resize(crop, square, resample=resample)) for crop in image_crops]
            num_local_patches.append(len(image_crops))
            # a newline after the last crop of every row but the last
            newline_masks.append([col == columns - 1 and row < rows - 1
                                  for row in range(rows) for col in range(columns)])

        data = {"pixel_values": np.stack(global_views), "num_local_patches": num_local_patches}
        if crops:
            data["pixel_values_local"] = np.stack(crops)  # (total crops, 3, patch_size, patch_size)
        result = BatchFeature(data=data, tensor_type=return_tensors)
        if crops:  # set after the tensor conversion: the masks stay lists of bools, padded to one length
            longest = max(num_local_patches)
            result["patch_newline_masks"] = [mask + [False] * (longest - len(mask)) for mask in newline_masks]
        return result


@dataclass(frozen=True)
class Step3p7Family(Family):
    def image_budget(self, processor, max_image_tokens: int | None) -> dict:
        """The image's longest side (`max_image_size`) capped at n crops, so that at most n x n
        crops fit beside the global view (at least one crop's side: an elongated image is still
        cut along its long side)."""
        view_tokens = getattr(processor, "num_image_feature_size", 0)  # the global view's tokens
        crop_tokens = getattr(processor, "num_patch_feature_size", 0)  # one local crop's
        if not (max_image_tokens and view_tokens and crop_tokens):
            return {}
        crops_per_side = max(1, math.isqrt(max(0, max_image_tokens - view_tokens) // crop_tokens))
        images = processor.image_processor
        return {"max_image_size": min(images.max_image_size, crops_per_side * images.patch_size)}

    def fitted_size(self, image_processor, width: int, height: int) -> tuple[int, int]:
        """Kept as it is: the local crops are cut from the full resolution."""
        return width, height


STEP3P7 = Step3p7Family("step3p7", ("step3p7",), pil_image_processor=Step3p7ImageProcessorPil,
                        placeholder_spellings=MARKUP_SPELLINGS + r"|<(im|patch)_(start|end)>|<patch_newline>")
FAMILIES = (STEP3P7,)
