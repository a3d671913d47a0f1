"""The project's own block drafter (models/drafter_heads.py: BlockDrafter), DFlash-style: one
forward pass proposes a whole block, at the target's own positions, M-RoPE included.

Serves: a `--drafter` folder or hub id whose config.json says model_type "block_drafter"
(trained for the bundled model by `python -m models.demo.train_drafters`). It must fit the
target: same hidden size and vocabulary, and the layers it reads must exist.
Reads from the target: the hidden states `target_hidden_layers` of its config.

The module's KV cache holds one context entry per committed token that the target has run:
the target's rows at those layers (concatenated, projected), at the token's own position.
With committed tokens x_0 .. x_T (the target has run x_0 .. x_{T-1}), a round is ONE forward
over the context rows not yet cached (context_len .. T-1, causal) and the block
[x_T, mask, ..., mask] at positions T .. T + block_size - 1 (the target's positions after the
prompt: i + rope_delta on every M-RoPE row), which sees every context row and the whole block.
Block rows 1 .. block_size - 1, through the target's output head, are the draft. The block's
own entries are cropped before the next round, so a rejection never has to be undone: rolling
back is only "append the rows of the accepted tokens" (`accept`). Worked example: prompt of 10
tokens, x_10 from prefill, block size 5. Round 1 runs context 0 .. 9 and the block at 10 .. 14
and drafts d_1 .. d_4. The target verifies [x_10, d_1 .. d_4] and accepts 1 (rows for x_10 and
d_1; bonus x_12). Round 2 crops the block (cache back to 10 entries), runs context 10 .. 11 and
the block [x_12, mask x 4] at 12 .. 16.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from engine.drafters.base import Draft, context_rows, draft_from_rows
from engine.drafters.target_head import TargetHead, load_module, require_hidden
from engine.drafters.target_positions import TargetPositions
from engine.prompt import Prompt
from engine.runner import CacheState, TargetReads
from engine.sampling import Sampler
from models.drafter_heads import BlockDrafterConfig, causal_mask


def serves(name: str, config) -> bool:
    return getattr(config, "model_type", None) == BlockDrafterConfig.model_type


def load(name: str, config, target, options) -> BlockDrafter:
    layers = tuple(config.target_hidden_layers)
    module = load_module(name, config, target, options, layers)
    return BlockDrafter(name, module, TargetHead(target, next(module.parameters()).dtype), target.family, layers)


class BlockDrafter:
    kind = "dflash"

    def __init__(self, name: str, module, head: TargetHead, family, layers: tuple[int, ...]):
        self.name, self.module, self.head, self.family = name, module, head, family
        self.layers = layers
        self.block_size = module.config.block_size
        self.reads = TargetReads(hidden_layers=layers)

    @torch.inference_mode()
    def begin(self, prompt: Prompt, target: CacheState) -> BlockSession:
        require_hidden(self.name, target, self.layers)
        return BlockSession(self, target)


class BlockSession:
    def __init__(self, drafter: BlockDrafter, target: CacheState):
        self.drafter, self.module, self.head, self.target = drafter, drafter.module, drafter.head, target
        self.positions = TargetPositions(drafter.family, target)
        self.cache = DynamicCache()
        self.context_len = 0  # context entries in the cache (tokens 0 .. context_len - 1)
        self.pending = context_rows(target, drafter.layers, len(target.hidden[drafter.layers[0]]))  # (m, L * H) rows not yet cached

    @torch.inference_mode()
    def propose(self, generated: list[int], k: int, sampler: Sampler) -> Draft:
        if k <= 0:
            return Draft([])
        size = self.drafter.block_size
        self.cache.crop(self.context_len - self.cache.get_seq_length())  # the previous round's block
        newest = self.context_len + len(self.pending)  # T: the anchor's index
        block = self.module.block_embeds(self.head.embed([generated[-1]])[None])  # (1, size, H)
        num_context = len(self.pending)
        mask = causal_mask(num_context + size, self.context_len, block.device).clone()
        mask[..., num_context:, :] = True  # block rows see all context and the whole block
        out = self.module(self.pending[None].to(self.head.dtype), block, self.positions(self.context_len, newest + size),
                          mask, self.cache)[0, num_context + 1:]  # (size - 1, H): the rows after the anchor
        self.context_len, self.pending = newest, None
        return draft_from_rows(sampler, self.head.logits(out[: min(k, size - 1)]))

    def accept(self, num_accepted: int) -> None:
        """Rows of the last committed token and the accepted drafts become context."""
        rows = context_rows(self.target, self.drafter.layers, num_accepted + 1)
        self.pending = rows if self.pending is None else torch.cat([self.pending, rows])

