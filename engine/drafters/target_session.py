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

from engine.drafters.base import Draft
from engine.drafters.target_positions import TargetPositions
from engine.runner import CacheState
from engine.sampling import Sampler
from engine.tree import best_nodes, grow_level, subtree


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


class ChainedHeadSession(TargetReadingSession):
    """A session whose draft entries chain after `context_len` entries fed by the target's rows,
    each reading the entry before it (EAGLE-3, the MTP head), so it can branch (engine/tree.py):
    `propose_tree` is EAGLE-2's beam on its own cache. Depth by depth, the `branching` best nodes
    of the newest depth get an entry each in one pass (its token, its parent's output, at its
    depth's position; it sees the context, its ancestors' entries and itself), whose logits give
    each its `branching` most likely children; the `budget` nodes of highest path probability
    make the tree. Nodes are top choices, not samples (engine/sampling.accept_tree). The tree's
    entries are cropped at the next round with the draft entries; the target's tree pass has cut
    its rows to the accepted path (`Runner.keep_path`), so `pending` is as after a chain.

    A subclass gives `_context(generated)` (the round's context entries run; (1, H) the newest
    one's output, which drafts d_1), `_logits(out)` ((n, V) of outputs (n, H)) and
    `_tree_entries(token_ids, parent_out, level, seen)` (the entries of nodes at depth level + 1,
    seen (n, cached + n) bool; their outputs (n, H))."""

    context_len: int  # entries fed by the target's rows

    @torch.inference_mode()
    def propose_tree(self, generated: list[int], depth: int, budget: int, branching: int, sampler: Sampler) -> Draft:
        outputs = {-1: self._context(generated)[0]}  # node -> its entry's output; -1: the newest context entry
        token_ids, parents, scores, run = [], [], [], []  # run: the nodes with an entry, in cache order
        beam = [-1]
        for level in range(depth):
            logits = self._logits(torch.stack([outputs[node] for node in beam]))
            probs = logits.softmax(-1) if sampler.settings.greedy else sampler.probs(logits)
            beam = grow_level(beam, probs.topk(min(branching, probs.shape[-1]), dim=-1), branching,
                              token_ids, parents, scores)
            if level == depth - 1 or not beam:
                break
            out = self._tree_entries([token_ids[node] for node in beam], torch.stack([outputs[parents[node]] for node in beam]),
                                     level, self._seen(beam, parents, run))
            outputs.update(zip(beam, out))
            run += beam
        kept = best_nodes(parents, scores, budget)
        token_ids, parents = subtree(token_ids, parents, kept)
        return Draft(token_ids, parents=parents)

    def tree_unsupported(self) -> str | None:
        return None

    def _seen(self, beam: list[int], parents: list[int], run: list[int]) -> torch.Tensor:
        """(n, context_len + len(run) + n) bool: each beam node sees the context, its ancestors' entries and itself."""
        cached = self.context_len + len(run)
        seen = torch.zeros(len(beam), cached + len(beam), dtype=torch.bool)
        seen[:, :self.context_len] = True
        for i, node in enumerate(beam):
            seen[i, cached + i] = True
            ancestor = parents[node]
            while ancestor >= 0:
                seen[i, self.context_len + run.index(ancestor)] = True
                ancestor = parents[ancestor]
        return seen

    def _context(self, generated: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _tree_entries(self, token_ids: list[int], parent_out: torch.Tensor, level: int, seen: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def tokens_from(prompt_ids: list[int], generated: list[int], first: int) -> list[int]:
    """Tokens first .. T of the request (prompt ids, then the answer), without building the
    whole sequence: O(T - first)."""
    if first >= len(prompt_ids):
        return generated[first - len(prompt_ids):]
    return prompt_ids[first:] + generated
