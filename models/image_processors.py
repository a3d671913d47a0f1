"""PIL image processors for the families whose transformers image processor needs torchvision.

transformers 5.24 ships Step-3.7's and MuseGlimmer's image processors as torchvision classes
only (`Step3p7ImageProcessor`, `MuseGlimmerImageProcessor`; Gemma 4 has its own
`Gemma4ImageProcessorPil`). These are the same algorithms on transformers' PIL backend
(`PilBackend`: numpy arrays, resizing with PIL), read from the folder's saved settings like the
stock classes, and saved under the stock class names.

What was compared (tests/test_image_processors.py):
- Step-3.7: transformers' own `Step3p7ImageProcessor` code (patch planning, square padding,
  global view, local crops, newline masks) run with torch's antialiased resize, as
  torchvision's `resize` runs it for uint8 images on a CPU, against this class on images
  with no crops, with crops, elongated, scaled down and near-degenerate: same shapes, crop
  counts and newline masks; pixel values apart by whole uint8 levels only (at most 2, where
  PIL's and torch's bilinear kernels round differently; the shares are in the test). The
  plan (`step3p7_plan`) equals transformers' `_plan_patches` over thousands of sizes.
- MuseGlimmer: transformers' own `smart_resize` and `patchify` against this class: same
  resize sizes over many image sizes and token caps, and identical `pixel_values` and
  `image_grid_thw` for the same resized image. The resize itself is PIL's LANCZOS here and
  torchvision's (>= 0.27) LANCZOS there; those two kernels were not compared.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_transforms import divide_to_patches
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling, SizeDict
from transformers.models.step3p7.image_processing_step3p7 import Step3p7ImageProcessor, Step3p7ImageProcessorKwargs
from transformers.processing_utils import ImagesKwargs

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


class MuseGlimmerImageProcessorKwargs(ImagesKwargs, total=False):
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    max_image_tokens: int


def muse_glimmer_smart_resize(height: int, width: int, patch_size: int, max_tokens: int) -> tuple[int, int]:
    """transformers' `muse_glimmer.image_processing_muse_glimmer.smart_resize`, copied because
    that module imports torchvision: the (height, width) in pixels of the whole grid of
    `patch_size` squares closest to the image's aspect ratio with at most `max_tokens` squares."""
    ideal_height, ideal_width = height / patch_size, width / patch_size
    ratio = ideal_width / ideal_height if ideal_height > 0 else 1.0
    if ideal_height * ideal_width > max_tokens:
        ideal_height = (max_tokens / ratio) ** 0.5
        ideal_width = ideal_height * ratio
    candidates = list(set(itertools.product([math.floor(ideal_height), math.ceil(ideal_height)],
                                            [math.floor(ideal_width), math.ceil(ideal_width)])))
    candidates = [(h, w) for h, w in candidates if h >= 1 and w >= 1 and h * w <= max_tokens]
    if not candidates:
        candidates = [(max(1, round(ideal_height)), max(1, round(ideal_width)))]
    grid_height, grid_width = min(candidates, key=lambda grid: abs(grid[0] / grid[1] - height / width))
    return grid_height * patch_size, grid_width * patch_size


class MuseGlimmerImageProcessorPil(PilBackend):
    """MuseGlimmer's images on PIL: resized to the grid of (patch_size * merge_size)-pixel squares
    closest to the image's aspect ratio, at most `max_image_tokens` squares (one token each),
    then cut into patch_size patches in row-major order, each flattened as (temporal, channel,
    y, x) with the image repeated over `temporal_patch_size` frames. Unlike Qwen2-VL's layout,
    patches are neither grouped by merge window nor flattened channel first."""

    do_resize, resample, size, default_to_square = True, PILImageResampling.LANCZOS, None, False
    do_rescale, rescale_factor, do_normalize, do_convert_rgb = True, 1 / 255, True, True
    image_mean, image_std = IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD
    patch_size, temporal_patch_size, merge_size, max_image_tokens = 14, 2, 2, 4096
    valid_kwargs = MuseGlimmerImageProcessorKwargs
    model_input_names = ["pixel_values", "image_grid_thw"]

    def _validate_preprocess_kwargs(self, **kwargs):
        kwargs["do_resize"] = False  # sized from patch_size and max_image_tokens, not from `size`
        super()._validate_preprocess_kwargs(**kwargs)

    def _preprocess(self, images: list[np.ndarray], do_resize: bool, resample, do_rescale: bool,
                    rescale_factor: float, do_normalize: bool, image_mean, image_std, patch_size: int,
                    temporal_patch_size: int, merge_size: int, max_image_tokens: int, return_tensors=None,
                    **kwargs) -> BatchFeature:
        pixel_values, grids = [], []
        for image in images:
            if do_resize:
                height, width = muse_glimmer_smart_resize(*image.shape[-2:], patch_size * merge_size, max_image_tokens)
                image = self.resize(image, SizeDict(height=height, width=width), resample=resample)
            if do_rescale:
                image = self.rescale(image, rescale_factor)
            if do_normalize:
                image = self.normalize(image, image_mean, image_std)
            channels, height, width = image.shape
            grid_height, grid_width = height // patch_size, width // patch_size
            patches = image.reshape(channels, grid_height, patch_size, grid_width, patch_size).transpose(1, 3, 0, 2, 4)
            patches = np.broadcast_to(patches[:, :, None], (grid_height, grid_width, temporal_patch_size, channels,
                                                            patch_size, patch_size))
            pixel_values.append(patches.reshape(grid_height * grid_width, -1))
            grids.append([1, grid_height, grid_width])
        data = {"pixel_values": np.concatenate(pixel_values), "image_grid_thw": np.array(grids)}
        return BatchFeature(data=data, tensor_type=return_tensors)

    def get_number_of_image_patches(self, height: int, width: int, images_kwargs=None) -> int:
        images_kwargs = images_kwargs or {}
        patch_size = images_kwargs.get("patch_size", self.patch_size)
        merge_size = images_kwargs.get("merge_size", self.merge_size)
        max_tokens = images_kwargs.get("max_image_tokens", self.max_image_tokens)
        resized_height, resized_width = muse_glimmer_smart_resize(height, width, patch_size * merge_size, max_tokens)
        return (resized_height // patch_size) * (resized_width // patch_size)


# transformers image processors that exist only as torchvision classes -> their PIL versions here
PIL_IMAGE_PROCESSORS = {
    "Step3p7ImageProcessor": Step3p7ImageProcessorPil,
    "MuseGlimmerImageProcessor": MuseGlimmerImageProcessorPil,
}
