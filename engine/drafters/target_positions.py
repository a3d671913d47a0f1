"""The target's rotary positions by token index, for drafters that run at the target's positions.

Token i of the request (prompt ids first, then the answer) sits where the target put it: in
the prompt, at the positions of the family's `prefill_positions` (three M-RoPE rows after an
image, where height and width differ from time); after the prompt, at i + rope_delta on every
row. Slices are taken on the sequence (last) axis, never on the rows.
"""

from __future__ import annotations

import torch

from engine.prompt import Prompt


class TargetPositions:
    def __init__(self, family, target_model, prompt: Prompt):
        inputs = {name: value.to(target_model.device) for name, value in prompt.target_inputs.items()}
        self.family = family
        self.prompt_positions, self.rope_delta = family.prefill_positions(target_model, inputs)  # (..., S)

    def __call__(self, first: int, stop: int) -> torch.Tensor:
        """Positions of tokens first .. stop - 1: (1, n) for 1-axis RoPE, (3, 1, n) for M-RoPE."""
        num_prompt = self.prompt_positions.shape[-1]
        parts = [self.prompt_positions[..., first:min(stop, num_prompt)]]
        if stop > num_prompt:
            start = max(first, num_prompt)
            parts.append(self.family.positions(start + self.rope_delta, stop - start, self.prompt_positions.device))
        return torch.cat(parts, dim=-1)
