"""Gemma 3: 1-axis RoPE with sliding-window layers. Image tokens attend bidirectionally at
prefill (the processor's token_type_ids go to the prefill forward). Sliding-window cache
layers only keep their window; the Runner turns on past recording so a rollback after a
rejected draft can restore the entries that slid out (transformers' `crop` then trims).
An image is a fixed number of tokens between <start_of_image> and <end_of_image>."""

from .base import MARKUP_SPELLINGS, Family

GEMMA3 = Family("gemma3", ("gemma3",), placeholder_spellings=MARKUP_SPELLINGS + r"|<(start|end)_of_image>")
FAMILIES = (GEMMA3,)
