"""Rotary cos / sin tables by position (engine/fast_decode.py's layers, engine/fast_heads.py's heads)."""

from __future__ import annotations

import torch


class RotaryTable:
    """Rotary cos and signed sin by position, as transformers computes them: in float32, then
    cast. signed_sin = sin with its first half negated: with x's halves swapped (x rolled by
    half its width), swapped(x) * signed_sin == rotate_half(x) * sin."""

    def __init__(self, rotary: torch.nn.Module, head_dim: int, dtype: torch.dtype):
        """rotary: the model's rotary embedding module (its inv_freq, and mrope_section if M-RoPE)."""
        self.inv_freq = rotary.inv_freq.float()
        self.head_dim, self.dtype = head_dim, dtype
        self.cos = self.signed_sin = torch.empty(0, head_dim, dtype=dtype, device=self.inv_freq.device)
        section = getattr(rotary, "mrope_section", None)
        if section is not None:  # M-RoPE: the row (0 time, 1 height, 2 width) each dimension reads
            rows = torch.cat([torch.full((size,), i % 3) for i, size in enumerate(section)])
            self.row_of = torch.cat([rows, rows]).to(self.inv_freq.device)  # (D,)

    def __call__(self, positions: torch.Tensor | range) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin (n, 1, D) at positions (n,) or a range of them (views of the table), or at
        M-RoPE positions (3, n): dimension d reads row row_of[d] (transformers' recomposition by
        mrope_section)."""
        end = positions.stop if isinstance(positions, range) else int(positions.max()) + 1
        if end > len(self.cos):  # extend the table (doubling) to cover `end`
            table_len = max(end, 2 * len(self.cos), 1024)
            freqs = torch.arange(table_len, device=self.inv_freq.device)[:, None].float() * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            sin = emb.sin()
            half = self.head_dim // 2
            self.cos = emb.cos().to(self.dtype)
            self.signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(self.dtype)
        if isinstance(positions, range):  # consecutive: slices of the table
            return self.cos[positions.start:end, None], self.signed_sin[positions.start:end, None]
        if positions.dim() == 1:
            return self.cos[positions][:, None], self.signed_sin[positions][:, None]
        index = self.row_of.expand(1, positions.shape[1], -1)  # (1, n, D)
        return tuple(table[positions].gather(0, index)[0][:, None] for table in (self.cos, self.signed_sin))
