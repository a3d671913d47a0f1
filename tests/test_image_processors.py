"""The PIL image processors of models/families/step3p7.py and muse_glimmer.py against transformers' own code.

transformers' Step-3.7 and MuseGlimmer image processors are torchvision classes, and torchvision
is not installed here. What of them runs without it is run:
- Step-3.7: the module imports without torchvision. `TorchStep3p7` is transformers' own
  `Step3p7ImageProcessor` (patch planning, square padding, global view, crops, newline masks,
  fused rescale + normalize) with the three torchvision calls it makes re-expressed in torch
  as torchvision 0.2x's `resize_image`, `pad` and `normalize` do them: a uint8 image on a CPU
  is resized by `interpolate(bilinear, antialias=True)` on the uint8 tensor itself where
  `"AVX2" in torch.backends.cpu.get_cpu_capability()`, else in float32 and rounded; padding
  adds zeros at the bottom and right; normalizing is (x - mean) / std.
- MuseGlimmer: the module imports torchvision at its top, so it is imported here with a stand-in
  `torchvision.transforms.v2.functional` that has only the names it reads at import; its
  `smart_resize` and `patchify` (pure torch) are then compared with ours.
"""

from __future__ import annotations

import enum
import importlib
import sys
import types
from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.image_utils import SizeDict
from transformers.models.step3p7.image_processing_step3p7 import Step3p7ImageProcessor

from models.families.muse_glimmer import MuseGlimmerImageProcessorPil, muse_glimmer_smart_resize
from models.families.step3p7 import Step3p7ImageProcessorPil, step3p7_plan


def picture(width: int, height: int, seed: int = 0) -> Image.Image:
    """Gradients plus noise: smooth areas and sharp edges, as photos have."""
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], axis=-1)
    noise = np.random.default_rng(seed).integers(0, 64, size=(height, width, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")


class TorchStep3p7(Step3p7ImageProcessor):
    """transformers' Step3p7ImageProcessor with torchvision's kernels written in torch. `uint8`:
    resize the uint8 tensor itself (torchvision does on CPUs whose capability names AVX2), else
    in float32 and round (elsewhere, this machine's "AVX512" included)."""

    def __init__(self, uint8_resize: bool, **kwargs):
        super().__init__(**kwargs)
        self.uint8_resize = uint8_resize

    def resize(self, image, size: SizeDict, resample=None, antialias=True, **kwargs):
        if tuple(image.shape[-2:]) == (size.height, size.width):
            return image  # torchvision returns the image unchanged
        source = image if self.uint8_resize else image.float()
        out = torch.nn.functional.interpolate(source, size=(size.height, size.width), mode="bilinear",
                                              align_corners=False, antialias=True)
        return out if self.uint8_resize else out.round().to(image.dtype)

    def pad(self, images, pad_size: SizeDict, **kwargs):
        def padded(image):  # zeros at the bottom and right
            right, bottom = pad_size.width - image.shape[-1], pad_size.height - image.shape[-2]
            return torch.nn.functional.pad(image, (0, right, 0, bottom))
        return [padded(image) for image in images]

    def normalize(self, image, mean, std, inplace=False, **kwargs):
        return (image - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)


STEP3P7_CASES = {  # (width, height): what the plan does with it
    "no crops": (200, 180),  # fits in the global view
    "elongated": (220, 100),  # fits, but longer than 1.5 x its width: windows of its short side
    "crops": (300, 170),  # larger than the view: 112-pixel windows, 3 x 2
    "scaled down": (700, 500),  # over max_image_size: scaled to 448 first
    "very long": (600, 90),  # ratio over 4: windows of its short side
    "degenerate": (200, 20),  # under 32 pixels and ratio over 4: padded to a square
}
STEP3P7_SETTINGS = dict(size={"height": 224, "width": 224}, patch_size=112, max_image_size=448)


@pytest.mark.parametrize("uint8_resize, share", [(True, 0.05), (False, 0.3)], ids=["uint8-kernel", "float-kernel"])
@pytest.mark.parametrize("case", STEP3P7_CASES)
def test_step3p7_pil_matches_transformers_code(case, uint8_resize, share):
    """Same keys, crop counts, newline masks and shapes; pixels apart only by rounding. PIL and
    torch both resize with Pillow's antialiased bilinear filter, in fixed point (PIL, torch's
    uint8 kernel) or float32 (rounded after): one resize moves a pixel by at most one uint8
    level, two (the global view of a scaled image) by two. Measured on these cases: at most 4 %
    of values differ against the uint8 kernel, 16-27 % against the float one."""
    image = picture(*STEP3P7_CASES[case])
    ours = Step3p7ImageProcessorPil(**STEP3P7_SETTINGS)(image, return_tensors="pt")
    theirs = TorchStep3p7(uint8_resize, **STEP3P7_SETTINGS)(image, return_tensors="pt")

    assert ours.keys() == theirs.keys()
    assert ours["num_local_patches"].tolist() == theirs["num_local_patches"].tolist()
    assert ours.get("patch_newline_masks") == theirs.get("patch_newline_masks")
    std = torch.tensor(Step3p7ImageProcessor.image_std).view(1, 3, 1, 1)
    for key in ("pixel_values", "pixel_values_local"):
        if key not in theirs:
            continue
        assert ours[key].shape == theirs[key].shape and ours[key].dtype == theirs[key].dtype == torch.float32
        levels = (ours[key] - theirs[key]) * std * 255  # the difference in uint8 levels
        assert (levels - levels.round()).abs().max() < 1e-3  # whole levels: the same pixels but for rounding
        assert levels.abs().max() < 2.01 and (levels.abs() > 0.5).float().mean() < share, (key, levels.abs().max())


def test_step3p7_plan_matches_transformers():
    rng = np.random.default_rng(0)
    sizes = [(int(w), int(h)) for w, h in rng.integers(1, 5000, size=(2000, 2))]
    sizes += [(w, h) for w in (1, 20, 31, 32, 100, 504, 600, 728, 729, 3024, 3025) for h in (1, 31, 100, 728, 2000)]
    for max_image_size in (448, 3024):
        stock = Step3p7ImageProcessor(max_image_size=max_image_size)
        for width, height in sizes:
            for image_size, patch_size in ((728, 504), (224, 112)):
                assert step3p7_plan(width, height, image_size, patch_size, max_image_size) == \
                    stock._plan_patches(width, height, image_size, patch_size), (width, height, image_size)


def test_step3p7_crops_and_tokens_of_a_real_size_photo():
    """Published settings (728-pixel view, 504-pixel crops): a 1280 x 853 photo is 3 x 2 crops,
    and the processor's prompt has 169 view tokens and 81 per crop."""
    ours = Step3p7ImageProcessorPil()(picture(1280, 853), return_tensors="pt")
    theirs = TorchStep3p7(uint8_resize=True)(picture(1280, 853), return_tensors="pt")
    assert ours["num_local_patches"].tolist() == theirs["num_local_patches"].tolist() == [6]
    assert ours["patch_newline_masks"] == theirs["patch_newline_masks"] == [[False, False, True, False, False, False]]
    assert ours["pixel_values_local"].shape == (6, 3, 504, 504) and ours["pixel_values"].shape == (1, 3, 728, 728)


@pytest.fixture(scope="module")
def muse_glimmer_module():
    """transformers' muse_glimmer image processing module, imported with a stand-in torchvision
    that has only what the module reads at import (its resize needs the real one: not run)."""
    functional = types.ModuleType("torchvision.transforms.v2.functional")
    functional.InterpolationMode = enum.Enum("InterpolationMode", "NEAREST BILINEAR BICUBIC LANCZOS")
    stand_ins = {"torchvision": types.ModuleType("torchvision"),
                 "torchvision.transforms": types.ModuleType("torchvision.transforms"),
                 "torchvision.transforms.v2": types.ModuleType("torchvision.transforms.v2"),
                 "torchvision.transforms.v2.functional": functional}
    stand_ins["torchvision.transforms.v2"].functional = functional
    name = "transformers.models.muse_glimmer.image_processing_muse_glimmer"
    with mock.patch.dict(sys.modules, stand_ins):
        module = importlib.import_module(name)
    sys.modules.pop(name, None)  # leave no module built on the stand-in behind
    return module


def test_muse_glimmer_resize_sizes_match_transformers(muse_glimmer_module):
    rng = np.random.default_rng(0)
    sizes = [(int(h), int(w)) for h, w in rng.integers(8, 4000, size=(300, 2))] + [(1, 5000), (5000, 3), (28, 28)]
    for height, width in sizes:
        for max_tokens in (4, 16, 1024, 4096):
            assert muse_glimmer_smart_resize(height, width, 28, max_tokens) == \
                muse_glimmer_module.smart_resize(height, width, 28, max_tokens), (height, width, max_tokens)


@pytest.mark.parametrize("size", [(300, 170), (64, 64), (90, 200)])
def test_muse_glimmer_pixels_match_transformers_layout(muse_glimmer_module, size):
    """The same resized image through ours and through transformers' rescale-and-normalize and
    `patchify`: identical pixel_values and grids."""
    processor = MuseGlimmerImageProcessorPil(max_image_tokens=16)
    ours = processor(picture(*size), return_tensors="pt")

    width, height = size
    resized_height, resized_width = muse_glimmer_module.smart_resize(height, width, 28, 16)
    resized = processor.resize(np.moveaxis(np.asarray(picture(*size)), -1, 0),
                               SizeDict(height=resized_height, width=resized_width), resample=processor.resample)
    mean, std = torch.tensor(processor.image_mean).view(1, 3, 1, 1), torch.tensor(processor.image_std).view(1, 3, 1, 1)
    normalized = (torch.from_numpy(resized)[None].float() / 255 - mean) / std
    patches, grid_h, grid_w = muse_glimmer_module.MuseGlimmerImageProcessor.patchify(None, normalized, 14, 2)

    assert ours["image_grid_thw"].tolist() == [[1, grid_h, grid_w]]
    torch.testing.assert_close(ours["pixel_values"], patches[0], atol=1e-6, rtol=0)
