"""SmolVLM and Idefics3: 1-axis RoPE; an image becomes <fake_token_around_image>, row/column
markers and <image> placeholders, all of which count as placeholder ids (never drafted)."""

from .base import Family

IDEFICS3 = Family("idefics3", ("idefics3",))
SMOLVLM = Family("smolvlm", ("smolvlm",))
FAMILIES = (IDEFICS3, SMOLVLM)
