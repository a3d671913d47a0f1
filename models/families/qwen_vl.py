"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL: M-RoPE with a per-request rope_delta (see base.MRopeFamily),
and images patchified under a pixel budget: one token is a (patch_size * merge_size)^2-pixel
square, and the processor (`smart_resize`) resizes an image to sides that are multiples of
that square's side, within [shortest_edge, longest_edge] pixels (both pixel counts there)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import MRopeFamily


MAX_RATIO = 200  # transformers' smart_resize refuses a longer side over 200 times the shorter


@dataclass(frozen=True)
class QwenVLFamily(MRopeFamily):
    """An M-RoPE family whose image processor is Qwen-VL's patchifier (Qwen3.5's too)."""

    def image_budget(self, processor, max_image_tokens: int | None) -> dict:
        """A pixel budget of at most `max_image_tokens` merged squares."""
        images = processor.image_processor
        if not max_image_tokens or not _is_patchifier(images):
            return {}
        max_pixels = min(images.size.longest_edge, max_image_tokens * (images.patch_size * images.merge_size) ** 2)
        return {"size": {"longest_edge": max_pixels,
                         "shortest_edge": min(images.size.shortest_edge or max_pixels, max_pixels)}}

    def fitted_size(self, image_processor, width: int, height: int) -> tuple[int, int] | None:
        """Exactly the size `smart_resize` gives when it shrinks (so the processor's output is bit
        for bit that of the full image); the same size when it would not shrink. ValueError for
        an aspect ratio over 200:1, which `smart_resize` refuses: said from the header, before
        such an image is decoded (a 40,000,000x1 PNG is 120 MB as RGB)."""
        if not _is_patchifier(image_processor):
            return None
        factor, max_pixels = image_processor.patch_size * image_processor.merge_size, image_processor.size.longest_edge
        if max(width, height) > MAX_RATIO * min(width, height):
            raise ValueError(f"an aspect ratio of {max(width, height) / min(width, height):,.0f}:1, over the "
                             f"{MAX_RATIO}:1 it takes")
        if round(height / factor) * factor * round(width / factor) * factor <= max_pixels:
            return width, height
        beta = math.sqrt(height * width / max_pixels)
        return (max(factor, math.floor(width / beta / factor) * factor),
                max(factor, math.floor(height / beta / factor) * factor))


def _is_patchifier(image_processor) -> bool:
    size = getattr(image_processor, "size", None)
    return bool(getattr(image_processor, "patch_size", None) and getattr(image_processor, "merge_size", None)
                and getattr(size, "longest_edge", None))


QWEN2_VL = QwenVLFamily("qwen2_vl", ("qwen2_vl",), direct_text_steps=True,
                        fast_text_types=("qwen2_vl_text", "qwen2_vl"), fast_heads=True, gguf_merger_blocks=3)
QWEN2_5_VL = QwenVLFamily("qwen2_5_vl", ("qwen2_5_vl",), direct_text_steps=True,
                          fast_text_types=("qwen2_5_vl_text", "qwen2_5_vl"), gguf_merger_blocks=3)
QWEN3_VL = QwenVLFamily("qwen3_vl", ("qwen3_vl",), direct_text_steps=True)
FAMILIES = (QWEN2_VL, QWEN2_5_VL, QWEN3_VL)
