"""The project's own block drafter (models/drafter_heads.py: BlockDrafter) as a DFlash block
model: the algorithm, its bookkeeping and a worked example are in engine/drafters/dflash.py;
this file loads the module and adapts its forward (`ModuleBlock`).

Serves: a `--drafter` folder or hub id whose config.json says model_type "block_drafter"
(trained for the bundled model by `python -m models.demo.train_drafters`). It must fit the
target: same hidden size and vocabulary, and the layers it reads must exist.
Reads from the target: the hidden states `target_hidden_layers` of its config.

Unlike transformers' DFlash assistants it is built from the target family's own decoder layers
with its M-RoPE rotary embedding, so it runs on Qwen-VL targets after images, and it embeds the
block with its own mask embedding (`block_embeds`) rather than a mask token id. It runs on the
fast path (engine/fast_heads.py, over a StaticKVCache) where it covers the module;
`fast_fallback` says why not.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from engine import fast_heads
from engine.drafters.dflash import DFlashDrafter
from engine.drafters.target_head import TargetHead, load_module
from engine.static_cache import StaticKVCache
from models.drafter_heads import BlockDrafterConfig, causal_mask


def serves(name: str, config) -> bool:
    return getattr(config, "model_type", None) == BlockDrafterConfig.model_type


def load(name: str, config, target, options) -> DFlashDrafter:
    layers = tuple(config.target_hidden_layers)
    module = load_module(name, config, target, options, layers)
    block = ModuleBlock(module, TargetHead.of(target, module))
    return DFlashDrafter(name, block, target.family, layers)


class ModuleBlock:
    """A BlockDrafter module and the target's embedding and head (TargetHead) as a BlockModel."""

    def __init__(self, module, head: TargetHead, fast: bool = True):
        self.module, self.head = module, head
        self.block_size = module.config.block_size
        self.fast_fallback = fast_heads.unsupported(module) if fast else "turned off"  # None: fast path
        self.fast = fast_heads.FastBlock(module) if self.fast_fallback is None else None
        self.forward = self.fast or module

    def new_cache(self, num_tokens: int) -> StaticKVCache | DynamicCache:
        return self.fast.new_cache(num_tokens) if self.fast else DynamicCache()

    def run(self, context: torch.Tensor, anchor: int, positions: torch.Tensor, cache) -> torch.Tensor:
        block = self.module.block_embeds(self.head.embed([anchor])[None])  # (1, size, H)
        num_context = len(context)
        mask = causal_mask(num_context + self.block_size, cache.get_seq_length(), block.device).clone()  # (.., new, all)
        mask[..., num_context:, :] = True  # block rows see all context and the whole block
        out = self.forward(context[None].to(self.head.dtype), block, positions, mask, cache)
        return out[0, num_context + 1:]  # (size - 1, H): the rows after the anchor

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        return self.head.logits(rows)
