"""The target's rotary positions by token index, for drafters that run at the target's positions.

Token i of the request (prompt ids first, then the answer) sits where the target put it: in
the prompt, at the positions its prefill used (three M-RoPE rows after an image, where height
and width differ from time; kept in the target's CacheState, never recomputed); after the
prompt, at i + rope_delta on every row. Slices are taken on the sequence (last) axis, never
on the rows.
"""

from __future__ import annotations

import torch

from engine.runner import CacheState
from models.families import Family


class TargetPositions:
    def __init__(self, family: Family, target: CacheState):
        self.family = family
        self.prompt_positions = target.prompt_positions  # (1, S) or (3, 1, S)
        self.rope_delta = target.rope_delta

    def __call__(self, first: int, stop: int) -> torch.Tensor:
        """Positions of tokens first .. stop - 1: (1, n) for 1-axis RoPE, (3, 1, n) for M-RoPE."""
        num_prompt = self.prompt_positions.shape[-1]
        parts = [self.prompt_positions[..., first:min(stop, num_prompt)]]
        if stop > num_prompt:
            start = max(first, num_prompt)
            parts.append(self.family.positions(start + self.rope_delta, stop - start, self.prompt_positions.device))
        return torch.cat(parts, dim=-1)
