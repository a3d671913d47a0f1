"""MuseGlimmer: 1-axis RoPE (NoPE on its full-attention layers), sliding-window layers between
them; each image expands to <|image_start|> <|patch|>... <|image_end|>. Its DFlash assistant
(`muse_glimmer_assistant`) drafts a block at a time from the target's hidden layers
(engine/drafters/dflash.py)."""

from .base import Family

MUSE_GLIMMER = Family("muse_glimmer", ("muse_glimmer",))
FAMILIES = (MUSE_GLIMMER,)
