"""MuseGlimmer: 1-axis RoPE (NoPE on its full-attention layers), sliding-window layers between
them; each image expands to <|image_start|> <|patch|>... <|image_end|>. Its DFlash assistant
(`muse_glimmer_assistant`) drafts a block at a time from the target's hidden layers
(engine/drafters/dflash.py).

Images: at most `max_image_tokens` merged squares. transformers 5.24 ships the image processor
as a torchvision class only (`MuseGlimmerImageProcessor`); `MuseGlimmerImageProcessorPil` below
is the same algorithm on transformers' PIL backend, saved under the stock class name.

What was compared (tests/test_image_processors.py):
- MuseGlimmer: transformers' own `smart_resize` and `patchify` against this class: same
  resize sizes over many image sizes and token caps, and identical `pixel_values` and
  `image_grid_thw` for the same resized image. The resize itself is PIL's LANCZOS here and
  torchvision's (>= 0.27) LANCZOS there; those two kernels were not compared.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling, SizeDict
from transformers.processing_utils import ImagesKwargs

from .base import Family


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


@dataclass(frozen=True)
class MuseGlimmerFamily(Family):
    def image_budget(self, processor, max_image_tokens: int | None) -> dict:
        """A number of tokens, at most the processor's own."""
        own = getattr(processor.image_processor, "max_image_tokens", None)
        return {"max_image_tokens": min(own, max_image_tokens)} if max_image_tokens and own else {}


MUSE_GLIMMER = MuseGlimmerFamily("muse_glimmer", ("muse_glimmer",), pil_image_processor=MuseGlimmerImageProcessorPil)
FAMILIES = (MUSE_GLIMMER,)
