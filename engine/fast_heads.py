"""The project's drafter heads (models/drafter_heads.py: MtpHead, BlockDrafter) on the fast path.

The same arithmetic as the modules' forward (RMSNorms in float32, the input projection, the
decoder layers, the final norm), with the decoder layers run by engine/fast_decode.py's
FastStack (the target's own layer function) over a StaticKVCache instead of transformers'
layers over a DynamicCache: a draft step costs about half the operator calls. Each fast head
is called as its module is, (B = 1, n, H) in and out, so a drafter swaps one for the other
with its cache (`new_cache`).

Covered: heads built from Qwen2-VL layers (`layers_from` "qwen2_vl", what
`python -m models.demo.train_drafters` trains). Heads from a Qwen3.5 checkpoint's MTP weights
(gated attention, q/k norms, (1 + w) norms, partial interleaved M-RoPE) keep their module's
forward; `unsupported` says why.
"""

from __future__ import annotations

import torch

from engine.fast_decode import FastStack, default_input_major, share, stack_unsupported
from engine.rows_kernel import rows_product
from engine.static_cache import HEADROOM, StaticKVCache
from models.families import fast_head_layers


def unsupported(module) -> str | None:
    """Why the fast path does not cover this MtpHead / BlockDrafter (None when it does)."""
    if module.config.layers_from not in fast_head_layers():  # as each family declares (models/families/)
        return f"a head built from {module.config.layers_from} layers (covered: {', '.join(fast_head_layers())})"
    return stack_unsupported(module.config.decoder_config(), module.stack.layers, module.stack.rotary)


class FastHead:
    """A head module's DecoderStack (layers, M-RoPE, final norm) on the fast path."""

    def __init__(self, module, input_major: bool | None = None):
        """module: an MtpHead or BlockDrafter (check `unsupported` first); its Linear weights
        become views of the fast path's buffers (same values), so its own forward still runs."""
        self.final_norm = module.stack.norm.weight  # (H,)
        self.input_major = default_input_major(self.final_norm) if input_major is None else input_major
        self.stack = FastStack(module.stack.layers, module.config.decoder_config(), module.stack.rotary,
                               self.input_major)

    def new_cache(self, num_tokens: int) -> StaticKVCache:
        """An empty cache with room for num_tokens entries and some headroom (it grows beyond)."""
        return self.stack.new_cache(num_tokens + HEADROOM)

    def run_stack(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                  cache: StaticKVCache) -> torch.Tensor:
        """DecoderStack.forward: x (n, H), positions (3, 1, n) or (1, n), mask (1, 1, n, cached + n)
        bool or None (causal); returns the normed outputs (1, n, H)."""
        n = len(x)
        positions = positions.reshape(-1, n)
        positions = positions[0] if len(positions) == 1 else positions
        x, _ = self.stack.forward(cache, x, positions, None if mask is None else mask[0, 0])
        return self.stack.norm(x, self.final_norm)[None]


class FastMtpHead(FastHead):
    @torch.no_grad()
    def __init__(self, module, input_major: bool | None = None):
        super().__init__(module, input_major)
        self.enorm, self.hnorm = module.enorm.weight, module.hnorm.weight
        self.fc = share([module.fc], self.input_major)  # (2 H, H)

    def __call__(self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                 mask: torch.Tensor | None, cache: StaticKVCache) -> torch.Tensor:
        """MtpHead.forward: embeds, hidden (1, n, H); position_ids (3, 1, n). Returns (1, n, H)."""
        x = rows_product(torch.cat([self.stack.norm(embeds[0], self.enorm), self.stack.norm(hidden[0], self.hnorm)],
                                   dim=-1), self.fc.t())
        return self.run_stack(x, position_ids, mask, cache)


class FastBlock(FastHead):
    @torch.no_grad()
    def __init__(self, module, input_major: bool | None = None):
        super().__init__(module, input_major)
        self.context_norm = module.context_norm.weight  # (L * H,)
        self.context_fc = share([module.context_fc], self.input_major)  # (L * H, H)

    def __call__(self, context: torch.Tensor, block: torch.Tensor, position_ids: torch.Tensor,
                 mask: torch.Tensor | None, cache: StaticKVCache) -> torch.Tensor:
        """BlockDrafter.forward: context (1, m, L * H), block (1, b, H) from `block_embeds`,
        position_ids (3, 1, m + b). Returns the outputs of every row (1, m + b, H)."""
        rows = rows_product(self.stack.norm(context[0], self.context_norm), self.context_fc.t()).to(block.dtype)
        return self.run_stack(torch.cat([rows, block[0]]), position_ids, mask, cache)
