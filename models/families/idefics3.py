"""SmolVLM and Idefics3: 1-axis RoPE; an image becomes <fake_token_around_image>, row/column
markers and <image> placeholders, all of which count as placeholder ids (never drafted).

Images are tiled: the image, resized to at most `size.longest_edge`, is cut into tiles of
`max_image_size.longest_edge` pixels, and each tile plus one global view is `image_seq_len`
tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import MARKUP_SPELLINGS, Family


@dataclass(frozen=True)
class TilingFamily(Family):
    def image_budget(self, processor, max_image_tokens: int | None) -> dict:
        """The resize before tiling capped so that at most n x n tiles fit the budget, or no
        splitting when even one tile would exceed it."""
        images = processor.image_processor
        tile = (getattr(images, "max_image_size", None) or {}).get("longest_edge")
        tokens_per_view = getattr(processor, "image_seq_len", None)
        if not (max_image_tokens and tile and tokens_per_view and getattr(images.size, "longest_edge", None)):
            return {}
        tiles_per_side = math.isqrt(max(0, max_image_tokens // tokens_per_view - 1))  # one view is global
        if tiles_per_side < 1:
            return {"do_image_splitting": False}
        return {"size": {"longest_edge": min(images.size.longest_edge, tiles_per_side * tile)}}


SPELLINGS = MARKUP_SPELLINGS + r"|<row_\d+_col_\d+>|<fake_token_around_image>|<global-img>"
# Their language model is a Llama; a config built here names no architecture for it, and the
# published SmolVLM checkpoints say VLlama3ForCausalLM (what llama.cpp's converter reads).
LLAMA_TEXT = dict(fast_text_types=("llama",), gguf_text_architectures=("VLlama3ForCausalLM",))
IDEFICS3 = TilingFamily("idefics3", ("idefics3",), placeholder_spellings=SPELLINGS, **LLAMA_TEXT)
SMOLVLM = TilingFamily("smolvlm", ("smolvlm",), placeholder_spellings=SPELLINGS, **LLAMA_TEXT)
FAMILIES = (IDEFICS3, SMOLVLM)
