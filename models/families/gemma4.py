"""Gemma 4: 1-axis RoPE, sliding-window and full-attention layers (the Runner keeps the past of
sliding layers for rollbacks, as for Gemma 3); each image expands to <|image> <|image|>...
<image|>. The last layer of each type stores its K/V for sharing, which its assistant
(`gemma4_assistant`) attends to instead of keeping a cache (engine/drafters/shared_cache.py).
An image is one of a few numbers of tokens (`max_soft_tokens`)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Family

SOFT_TOKENS = (70, 140, 280, 560, 1120)  # the tokens per image Gemma4ImageProcessorPil accepts


@dataclass(frozen=True)
class Gemma4Family(Family):
    def image_budget(self, processor, max_image_tokens: int | None) -> dict:
        """The largest accepted size within the budget and the processor's own, at least 70."""
        own = getattr(processor.image_processor, "max_soft_tokens", None)
        if not (max_image_tokens and own):
            return {}
        sizes = [n for n in SOFT_TOKENS if n <= min(own, max_image_tokens)]
        return {"max_soft_tokens": max(sizes, default=SOFT_TOKENS[0])}


GEMMA4 = Gemma4Family("gemma4", ("gemma4",))
FAMILIES = (GEMMA4,)
