"""What the engine needs to know about a model family: how it numbers rotary positions, how
its processor turns images into tokens, and what it supports (the fast path, drafter heads on it,
GGUF quirks) (`Family`, below: the one place a family's knowledge lives; models/families/__init__.py registers every family of this package by model type).

Two kinds of positional bookkeeping exist among the supported models:

- 1-axis RoPE (SmolVLM / Idefics3, LLaVA, Gemma 3, Gemma 4, Step-3.7, MuseGlimmer, every
  text-only LM): the rotary position of a token equals its KV-cache index.
- M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5): an image of h x w merged patches fills
  h*w KV slots but advances the rotary position by max(h, w). After an image the next rotary
  position is `cache_len + rope_delta`, with `rope_delta` (usually negative) computed once
  per request at prefill. Every later decode and verify position is shifted by it.

Other differences live elsewhere: the cache of a hybrid target (Qwen3.5's linear-attention
layers) is rolled back by engine/linear_attention_rollback.py, chosen at load from the config; sliding-window
layers (Gemma 3 / 4, MuseGlimmer) keep their recorded past for rollbacks in the Runner.

A family turns a prefill's processor outputs into explicit `position_ids` and a `rope_delta`,
and makes the position ids of `n` new tokens from the next rotary position. The engine always
passes positions explicitly; it never relies on state a model keeps on itself.

On the image side a family loads its processor (`load_processor`), says which options cap the
tokens of one image (`image_budget`), which token ids are image markup (`placeholder_ids`),
and, where its processor resizes by a rule of its own, to what size (`fitted_size`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from transformers.processing_utils import ProcessorMixin

from models import processors

# Added tokens that are image or video markup in any family: Qwen's <|vision_start|>,
# <|image_pad|>, Gemma 4's <|image>, <image|>, LLaVA's <image>... Families add their own.
MARKUP_SPELLINGS = r"<\|?(image|video|vision)[\w-]*\|?>"


@dataclass(frozen=True)
class Family:
    """A 1-axis RoPE family: rotary position == KV index, rope_delta is 0."""

    name: str
    model_types: tuple[str, ...]
    # A pass over new text tokens may call the language model and the output head directly:
    # the multimodal wrapper only embeds tokens and then calls them (the saving, measured:
    # docs/benchmarks.md). Set for families whose wrapper does nothing else to text tokens.
    direct_text_steps: bool = False
    # Spellings (a regular expression) of added tokens that are image markup although no
    # processor attribute names them; matched against the tokenizer's added tokens only.
    placeholder_spellings: str = MARKUP_SPELLINGS
    # The family's PIL image processor class, where transformers has only a torchvision one.
    pil_image_processor: type | None = None
    # What else the family supports, declared here so that no other file lists families:
    # - the fast decode path (engine/fast_decode.py) runs decoder layers of these text model types
    #   (the VLM's `text_config.model_type`, or a text LM's own; empty: transformers' forward);
    fast_text_types: tuple[str, ...] = ()
    # - drafter heads built from this family's layers (models/drafter_heads.py `layers_from`, the
    #   family's name) run on the fast path too (engine/fast_heads.py);
    fast_heads: bool = False
    # - GGUF conversion (models/gguf.py): llama.cpp's name map must cover this many vision-merger
    #   blocks (Qwen2-VL's projector: mlp.0, GELU, mlp.2), and a config whose text_config names no
    #   architectures gets these (what the published checkpoints say).
    gguf_merger_blocks: int = 0
    gguf_text_architectures: tuple[str, ...] = ()

    def load_processor(self, path_or_id: str, trust_remote_code: bool = False) -> ProcessorMixin:
        """The processor saved with a model of this family (models/processors.py: image-only
        where the stock class needs torchvision). ValueError, saying what to do, if there is none."""
        return processors.load_processor(path_or_id, trust_remote_code, self.pil_image_processor)

    def image_budget(self, processor: ProcessorMixin, max_image_tokens: int | None) -> dict:
        """Processor call options that make each image at most about `max_image_tokens` tokens
        (None or 0: the processor's own limits); never more than the processor allows. Here: an
        image is a fixed number of tokens (LLaVA, Gemma 3), nothing to cap."""
        return {}

    def placeholder_ids(self, processor: ProcessorMixin) -> set[int]:
        """Ids of every image placeholder or marker token this family's processor inserts."""
        return processors.placeholder_ids(processor, re.compile(self.placeholder_spellings))

    def fitted_size(self, image_processor, width: int, height: int) -> tuple[int, int] | None:
        """The (width, height) this family's image processor resizes a width x height image to,
        where it follows a rule of its own (the same size when it keeps the image as it is);
        None: the generic rules apply (edges, fixed sizes: engine/images.py fit_to_processor)."""
        return None

    def prefill_positions(self, model, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """Position ids for the prompt, shape (1, S), and the request's rope_delta (0 here)."""
        seq_len = inputs["input_ids"].shape[1]
        return torch.arange(seq_len, device=inputs["input_ids"].device)[None], 0

    def text_step(self, model, input_ids: torch.Tensor, position_ids: torch.Tensor, cache, num_logits: int,
                  attention_mask: torch.Tensor | None = None):
        """Logits (1, num_logits, V) of a pass over text tokens input_ids (1, n), appended to `cache`,
        through the language model and output head alone (families with `direct_text_steps`);
        attention_mask: None (causal) or a 4-D one (a draft tree's)."""
        embeds = model.model.get_input_embeddings()(input_ids)
        hidden = model.model.language_model(inputs_embeds=embeds, position_ids=position_ids, cache=cache,
                                            attention_mask=attention_mask, use_cache=True).last_hidden_state
        return model.lm_head(hidden[:, -num_logits:])

    def positions(self, rope_pos: int, num_tokens: int, device) -> torch.Tensor:
        """Position ids of `num_tokens` new tokens starting at rotary position `rope_pos`: (1, n)."""
        return torch.arange(rope_pos, rope_pos + num_tokens, device=device)[None]


@dataclass(frozen=True)
class MRopeFamily(Family):
    """Qwen-style M-RoPE: three position rows (temporal, height, width) and a per-request rope_delta."""

    def prefill_positions(self, model, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """Position ids (3, 1, S) from the model's own `get_rope_index`, and rope_delta."""
        if inputs.get("image_grid_thw") is None:  # text only: all three rows are 0..S-1
            seq_len = inputs["input_ids"].shape[1]
            return torch.arange(seq_len, device=inputs["input_ids"].device).expand(3, 1, -1), 0
        position_ids, rope_deltas = model.model.get_rope_index(
            input_ids=inputs["input_ids"],
            mm_token_type_ids=inputs["mm_token_type_ids"],
            image_grid_thw=inputs["image_grid_thw"],
            attention_mask=inputs.get("attention_mask"),
        )
        return position_ids, int(rope_deltas.reshape(-1)[0])

    def positions(self, rope_pos: int, num_tokens: int, device) -> torch.Tensor:
        """Position ids (3, 1, n): text tokens after the prompt advance all three rows together."""
        return torch.arange(rope_pos, rope_pos + num_tokens, device=device).expand(3, 1, -1)
