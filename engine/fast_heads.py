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

`FastEagle3` runs an EAGLE-3 checkpoint's layer (models/eagle3.py) in one compiled call
(fast_layer.cpp `eagle3_layer`: its two input norms, the attention over its 2 H-wide input, its
own residual, the MLP) over a StaticKVCache layer: in eager PyTorch the layer's 40-odd operator
calls and SDPA cost about three quarters of the SmolLM2 demo's draft step; `eagle3_unsupported`
says which checkpoints keep the module's forward.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine import fast_native
from engine.fast_decode import FastStack, default_input_major, share, stack_unsupported
from engine.rotary import RotaryTable
from engine.static_cache import attention_dtype
from engine.quantized import native_layer
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
        x, _ = self.stack.forward([cache], x, [positions], [None if mask is None else mask[0, 0]])
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


def eagle3_unsupported(module) -> str | None:
    """Why the compiled EAGLE-3 layer does not cover this models/eagle3.Eagle3 (None when it does)."""
    config = module.config
    if fast_native.layer() is None or module.fc.weight.device.type != "cpu":
        return "no compiled module on this device"
    if module.fc.weight.dtype not in (torch.float32, torch.bfloat16):
        return f"a {module.fc.weight.dtype} layer (covered: float32, bfloat16)"
    if config.qk_norm:
        return "q/k norms"
    if config.mrope_interleaved:
        return "interleaved M-RoPE (Qwen3-VL's layout)"
    if config.hidden_act != "silu":
        return f"{config.hidden_act} activation"
    return None


class Eagle3Cache:
    """models/eagle3.KVCache's interface (len, crop(length) keeps the first length entries) over a
    one-layer StaticKVCache, which the compiled layer writes in place."""

    def __init__(self, static: StaticKVCache):
        self.static = static

    def __len__(self) -> int:
        return self.static.length

    def crop(self, length: int) -> None:
        self.static.length = min(length, self.static.length)


class FastEagle3:
    """models/eagle3.py's Eagle3.forward (check `eagle3_unsupported` first), called as the module is,
    over an Eagle3Cache (`new_cache`); the module's weights become views of the fused buffers."""

    @torch.no_grad()
    def __init__(self, module):
        config, attention = module.config, module.midlayer.self_attn
        self.native = fast_native.layer()
        self.hidden_norm = module.midlayer.hidden_norm.weight  # (H,)
        self.normed_residual = config.norm_before_residual
        self.layer = native_layer(self.native, FastStack.layer_weights(module.midlayer, input_major=False))
        rotary = SimpleNamespace(inv_freq=module.inv_freq, mrope_section=config.mrope_section)
        self.rotary = RotaryTable(rotary, config.head_dim, self.hidden_norm.dtype)
        self.sizes = (attention.heads, attention.kv_heads, attention.head_dim, attention.head_dim ** -0.5,
                      config.rms_norm_eps)
        self.cache_dtype = attention_dtype(self.hidden_norm.dtype, self.hidden_norm.device)
        self.final_norm = module.norm.weight if config.norm_logits else None  # (H,)
        self.head = self.native.Weight(module.lm_head.weight.t())  # (H, draft vocab)

    def new_cache(self, num_tokens: int) -> Eagle3Cache:
        """An empty cache with room for num_tokens entries and some headroom (it grows beyond)."""
        _, kv_heads, head_dim = self.sizes[:3]
        return Eagle3Cache(StaticKVCache(1, kv_heads, head_dim, num_tokens + HEADROOM, self.cache_dtype,
                                         self.hidden_norm.device))

    def __call__(self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                 cache: Eagle3Cache, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Eagle3.forward: embeds, hidden (1, n, H); position_ids (1, n) or (3, 1, n); mask (1, 1, n,
        cached + n) bool or None (causal over the new entries). Returns the pre-norm h (1, n, H)."""
        static, n = cache.static, embeds.shape[1]
        start = static.length
        static.reserve(n)
        positions = position_ids.reshape(-1, n)
        cos, signed_sin = self.rotary(positions[0] if len(positions) == 1 else positions)
        if mask is None and n > 1:  # causal: row i sees slots 0 .. start + i
            mask = torch.ones(n, start + n, dtype=torch.bool, device=embeds.device).tril(start)
        h = self.native.eagle3_layer(embeds[0], hidden[0], self.hidden_norm, self.layer, cos.contiguous(),
                                     signed_sin.contiguous(), static.keys[0], static.values[0], start, mask,
                                     *self.sizes, self.normed_residual)
        static.length = start + n
        return h[None]

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Eagle3.draft_logits: (n, draft vocab) of pre-norm rows h (n, H), the norm and the product in one call."""
        if self.final_norm is None:
            return rows_product(h, self.head.values.t())
        return self.native.logits(h, self.final_norm, self.head, None, self.sizes[-1], len(h))
