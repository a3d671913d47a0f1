"""Gemma 4: 1-axis RoPE, sliding-window and full-attention layers (the Runner keeps the past of
sliding layers for rollbacks, as for Gemma 3); each image expands to <|image> <|image|>...
<image|>. The last layer of each type stores its K/V for sharing, which its assistant
(`gemma4_assistant`) attends to instead of keeping a cache (engine/drafters/shared_cache.py)."""

from .base import Family

GEMMA4 = Family("gemma4", ("gemma4",))
FAMILIES = (GEMMA4,)
