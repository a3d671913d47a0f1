"""DFlash block drafting: a small model drafts a whole block in one forward from several of the
target's hidden layers, at the target's own positions. Two kinds of checkpoint run it: a
DFlash assistant of transformers (`muse_glimmer_assistant`, `speculation_type="dflash"`,
served here) and the project's own block drafter (engine/drafters/block.py); each is a
`BlockModel` (below), and `DFlashSession` is the one algorithm for both.

Serves: a `--drafter` folder or hub id whose config names `target_layer_ids` and `block_size`;
it must fit the target (layers it reads exist, same hidden size, mask token in the vocabulary,
the target's kind of rotary positions). Reads from the target: hidden states after each of
`target_layer_ids`.

The block model's KV cache holds one *context* entry per committed token that the target has
run: the target's rows at the read layers (concatenated, projected by the block model), at the
token's own position. With committed tokens x_0 .. x_T (the target has run x_0 .. x_{T-1}), a
round is ONE forward over the context rows not yet cached (context_len .. T-1) and the block
[x_T, mask, ..., mask] at positions T .. T + block_size - 1 (the target's positions: the
prompt's from its prefill, i + rope_delta on every M-RoPE row after it), which sees every
context row and the whole block. Block rows 1 .. block_size - 1, through the target's output
head, are the draft. The block's own entries are cropped before the next round, so a
rejection never has to be undone: rolling back is only "append the rows of the accepted
tokens" (`accept`). Worked example: prompt of 10 tokens, x_10 from prefill, block size 5.
Round 1 runs context 0 .. 9 and the block at 10 .. 14 and drafts d_1 .. d_4. The target
verifies [x_10, d_1 .. d_4] and accepts 1 (rows for x_10 and d_1; bonus x_12). Round 2 crops
the block (cache back to 10 entries), runs context 10 .. 11 and the block [x_12, mask x 4] at
12 .. 16.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import AutoModel

from engine.drafters.base import Draft, draft_from_rows
from engine.drafters.target_head import require_hidden
from engine.drafters.target_session import TargetReadingSession
from engine.prompt import Prompt
from engine.runner import CacheState, TargetReads
from engine.sampling import Sampler
from models.loading import LoadError, LoadOptions, from_pretrained, model_kwargs


class BlockModel(Protocol):
    """What a DFlash session needs of a block model."""

    block_size: int  # the anchor plus block_size - 1 drafted rows
    fast_fallback: str | None  # why its steps do not run on the fast path (None: they do)

    def new_cache(self, num_tokens: int):
        """An empty cache for a request whose context will start with num_tokens rows."""

    def run(self, context: torch.Tensor, anchor: int, positions: torch.Tensor, cache) -> torch.Tensor:
        """Append context rows (m, L * H) to `cache`, then run the block [anchor, mask...] at the
        last block_size of `positions` ((1, m + size) or (3, 1, m + size)); returns the block's
        rows after the anchor, (block_size - 1, H)."""

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """(n, V) float32 logits of block rows (n, H) through the target's output head."""


def serves(name: str, config) -> bool:
    """A DFlash assistant's config names the target layers it reads and its block size."""
    return getattr(config, "target_layer_ids", None) is not None and getattr(config, "block_size", None) is not None


def load(name: str, config, target, options: LoadOptions) -> DFlashDrafter:
    text_config = target.model.config.get_text_config()
    problems = []
    if max(config.target_layer_ids) >= text_config.num_hidden_layers:
        problems.append(f"it reads target layers {config.target_layer_ids}, the target has {text_config.num_hidden_layers}")
    if config.hidden_size != text_config.hidden_size:
        problems.append(f"its hidden size is {config.hidden_size}, the target's {text_config.hidden_size}")
    if config.mask_token_id >= target.vocab_size:
        problems.append(f"its mask token {config.mask_token_id} is outside the target's vocabulary of {target.vocab_size}")
    if target.family.positions(0, 1, "cpu").dim() != 2:
        problems.append(f"its rotary embedding is 1-axis, the target ({target.family.name}) numbers positions "
                        "on three M-RoPE rows")
    if problems:
        raise LoadError(f"DFlash drafter {name!r} ({config.model_type}) does not fit the target {target.name!r}: "
                        + "; ".join(problems) + ". Use the assistant trained for this target.")
    assistant = from_pretrained(AutoModel, name, model_kwargs(options))  # the target's dtype: it reads its states
    layers = tuple(i + 1 for i in config.target_layer_ids)  # hidden_states[0] = embeddings
    return DFlashDrafter(name, AssistantBlock(assistant, target.model), target.family, layers)


class DFlashDrafter:
    kind = "dflash"

    def __init__(self, name: str, block: BlockModel, family, layers: tuple[int, ...]):
        self.name, self.block, self.family, self.layers = name, block, family, layers
        self.block_size = block.block_size
        self.reads = TargetReads(hidden_layers=layers)
        self.fast_fallback = block.fast_fallback

    @torch.inference_mode()
    def begin(self, prompt: Prompt, target: CacheState) -> DFlashSession:
        require_hidden(self.name, target, self.layers)
        return DFlashSession(self, target)


class DFlashSession(TargetReadingSession):
    def __init__(self, drafter: DFlashDrafter, target: CacheState):
        super().__init__(drafter.family, target, drafter.layers)  # pending: the prompt's context rows
        self.block = drafter.block
        self.cache = self.block.new_cache(len(self.pending))
        self.context_len = 0  # context entries in the cache (tokens 0 .. context_len - 1)
        self.block_in_cache = False  # the last round's block entries follow the context

    @torch.inference_mode()
    def propose(self, generated: list[int], k: int, sampler: Sampler) -> Draft:
        if k <= 0:
            return Draft([])
        size = self.block.block_size
        if self.block_in_cache:
            self.cache.crop(-size)  # evict the previous round's block
        context = self.take_pending()
        newest = self.context_len + len(context)  # T: the anchor's index
        rows = self.block.run(context, generated[-1], self.positions(self.context_len, newest + size), self.cache)
        self.context_len, self.block_in_cache = newest, True
        return draft_from_rows(sampler, self.block.logits(rows[: min(k, size - 1)]))


class AssistantBlock:
    """transformers' DFlash assistant (e.g. MuseGlimmerAssistantModel; its config names
    target_layer_ids, block_size and mask_token_id) as a BlockModel."""

    fast_fallback = "a transformers DFlash assistant: its own forward and DFlashCache (no fast path written)"

    def __init__(self, assistant, target_model):
        self.assistant, self.target_model = assistant, target_model
        self.block_size = assistant.config.block_size
        self.mask_token_id = assistant.config.mask_token_id

    def new_cache(self, num_tokens: int):
        from transformers.cache_utils import DFlashCache

        cache = DFlashCache(config=self.assistant.config)
        cache.activate_past_recording()
        return cache

    def run(self, context: torch.Tensor, anchor: int, positions: torch.Tensor, cache) -> torch.Tensor:
        cache.set_previous_accepted_tokens(len(context))
        block_ids = torch.tensor([anchor] + [self.mask_token_id] * (self.block_size - 1), device=self.assistant.device)
        return self.assistant(
            noise_embeds=self.embed(block_ids)[None],
            context_hidden_states=context[None].to(self.assistant.dtype),
            position_ids=positions.to(self.assistant.device),
            cache=cache,
        ).last_hidden_state[0, 1:]  # (block_size - 1, H): the positions after the anchor

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        head = self.target_model.get_output_embeddings()
        return head(rows.to(head.weight.dtype)).float()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's input embeddings, without an embedding norm (as transformers' DFlash does)."""
        embedding = self.target_model.get_input_embeddings()
        if getattr(embedding, "embed_norm", None) is not None:
            return torch.nn.Embedding.forward(embedding, ids)
        return embedding(ids)
