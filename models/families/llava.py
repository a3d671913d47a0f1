"""LLaVA: 1-axis RoPE; each image expands to a run of <image> placeholders."""

from .base import Family

LLAVA = Family("llava", ("llava",))
FAMILIES = (LLAVA,)
