"""The base session of every drafter that reads the target (MTP layers, the MTP head, DFlash
block drafters), as vLLM's EAGLE, MTP and DFlash proposers share one base proposer.

Such a drafter declares in `reads` which hidden layers each target pass must keep; the loop
calls `accept(num_accepted)` after each pass (`accept(num_accepted, path)` after a tree, whose
pass's rows the runner has cut to the accepted path), and the pass's rows for the last committed
token and the accepted drafts (its first num_accepted + 1 rows) are queued in `pending` until the
drafter's next round consumes them (`take_pending`). Rows of rejected drafts are never queued,
so nothing the drafter keeps has to be undone for them.

What a session gets here:
- `target`: the request's CacheState, whose `hidden` holds the last pass's rows of the read layers;
- `positions`: the target's rotary positions by token index (target_positions.py);
- `pending`: (m, L * H) rows, `layers` concatenated, of committed tokens not yet consumed; at
  first the prefill's rows of the whole prompt;
- `embeds(first, token_ids)`: input embeddings of tokens first .. first + n - 1 as the target
  saw them: its merged ones in the prompt (image features at image positions, hidden state 0
  of the prefill, `prompt_embeds`), the embedding table (`embed_tokens`) after it.
"""

from __future__ import annotations

import torch

from engine.drafters.target_positions import TargetPositions
from engine.runner import CacheState


class TargetReadingSession:
    def __init__(self, family, target: CacheState, layers: tuple[int, ...]):
        self.target = target
        self.layers = layers  # the hidden layers whose rows are queued in `pending`
        self.positions = TargetPositions(family, target)
        self.pending: torch.Tensor | None = self.target_rows(len(target.hidden[layers[0]]))  # (S, L * H)
        self.prompt_embeds: torch.Tensor | None = None  # (S, H), for sessions that call `embeds`

    def target_rows(self, num_rows: int) -> torch.Tensor:
        """(num_rows, L * H): the first rows of the target's last pass, `layers` concatenated."""
        return torch.cat([self.target.hidden[layer][:num_rows] for layer in self.layers], dim=-1)

    def accept(self, num_accepted: int, path: list[int] | None = None) -> None:
        """The last pass's rows for the last committed token and the accepted drafts join `pending`
        (after a tree pass the runner's `keep_path` has put the accepted `path`'s rows first)."""
        rows = self.target_rows(num_accepted + 1)
        self.pending = rows if self.pending is None else torch.cat([self.pending, rows])

    def take_pending(self) -> torch.Tensor:
        """(m, L * H) the queued rows, which the caller now consumes; the queue is empty after."""
        rows, self.pending = self.pending, None
        return rows

    def embeds(self, first: int, token_ids: list[int]) -> torch.Tensor:
        """(n, H) input embeddings of tokens first .. first + n - 1 (see the module docstring)."""
        num_prompt = max(0, min(len(self.prompt_embeds) - first, len(token_ids)))
        parts = [self.prompt_embeds[first:first + num_prompt]]
        if num_prompt < len(token_ids):
            parts.append(self.embed_tokens(token_ids[num_prompt:]))
        return torch.cat(parts)

    def embed_tokens(self, token_ids: list[int]) -> torch.Tensor:
        """(n, H) embeddings of answer tokens in `prompt_embeds`' dtype; sessions that call `embeds` define it."""
        raise NotImplementedError


def tokens_from(prompt_ids: list[int], generated: list[int], first: int) -> list[int]:
    """Tokens first .. T of the request (prompt ids, then the answer), without building the
    whole sequence: O(T - first)."""
    if first >= len(prompt_ids):
        return generated[first - len(prompt_ids):]
    return prompt_ids[first:] + generated
