"""A preallocated KV cache indexed by slot (gpt-fast's cache), for engine/fast_decode.py.

A pass writes its K/V in place at slots length .. length + n - 1; nothing is concatenated per
token. Rolling back is moving `length` back: the stale entries are overwritten by the next
pass. The buffers double when a pass would not fit (a copy, once per doubling).

    keys[layer], values[layer]: (1, kv_heads, capacity, head_dim); entries 0 .. length - 1 valid.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

HEADROOM = 256  # free slots after the prompt before the first doubling


class StaticKVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device):
        shape = (1, kv_heads, capacity, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = 0

    @classmethod
    def from_dynamic(cls, cache: DynamicCache, dtype: torch.dtype | None = None) -> StaticKVCache:
        """The entries of a prefilled DynamicCache (full-attention layers only), copied into buffers
        of `dtype` (default: the entries')."""
        first = cache.layers[0].keys  # (1, kv_heads, S, head_dim)
        _, kv_heads, length, head_dim = first.shape
        static = cls(len(cache.layers), kv_heads, head_dim, length + HEADROOM, dtype or first.dtype, first.device)
        for index, layer in enumerate(cache.layers):
            static.keys[index][:, :, :length] = layer.keys
            static.values[index][:, :, :length] = layer.values
        static.length = length
        return static

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def get_seq_length(self) -> int:
        return self.length

    def reserve(self, num_tokens: int) -> None:
        """Make room for a pass of `num_tokens` after the held entries."""
        needed = self.length + num_tokens
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity)
        for buffers in (self.keys, self.values):
            for index, old in enumerate(buffers):
                grown = old.new_empty(old.shape[:2] + (capacity,) + old.shape[3:])
                grown[:, :, :self.length] = old[:, :, :self.length]
                buffers[index] = grown

    def crop(self, tokens_to_remove: int) -> None:
        """As DynamicCache.crop (transformers 5): crop(-n) drops the last n entries; crop(0) nothing."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes minus the number of entries to drop, not {tokens_to_remove}")
        self.length += tokens_to_remove

    def move(self, start: int, source: torch.Tensor) -> None:
        """Entries `source` (slot indices, ascending, each >= start) moved to start, start + 1, ..."""
        for buffers in (self.keys, self.values):
            for buffer in buffers:
                buffer[:, :, start:start + len(source)] = buffer[:, :, source]


def attention_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's and attention's dtype: float32 for 16-bit weights on a CPU. The cache holds
    the same (16-bit) values; float32 attention there costs a third of bfloat16's at a short
    context (no native bfloat16 arithmetic: docs/performance.md) and accumulates in float32 as
    SDPA's 16-bit kernel does."""
    return torch.float32 if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) else dtype
