"""Targets with linear-attention layers (Qwen3.5): rolling back a recurrent state.

A linear-attention layer keeps no per-token cache that a rollback could crop: it keeps a
convolution state (the last few inputs) and a recurrent state that every token folds into.
After a verify pass over [last, d1 .. dk] the state holds all k draft tokens, accepted or not.

Rollback here = snapshot and replay, with the replay folded into the next pass:
- before a verify pass with a draft, `extend` copies the linear layers' states (a snapshot);
- `rollback(n)` after a partial acceptance puts the whole cache back to the snapshot (the
  attention layers are cropped to the same point) and remembers the kept tokens of that pass,
  [last, d1 .. da], as *pending*: committed, but not in the cache;
- the next `extend` runs pending + its own tokens in one pass and returns the logits (and hidden
  states) of its own tokens only.
So a rejection costs a copy of the recurrent states and a few extra rows in the next pass, never
an extra forward. `cache_len` and `rope_pos` count the pending tokens: they describe the
committed sequence, as for any other target.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from engine.runner import NO_READS, CacheState, Runner, TargetReads


@dataclass
class Snapshot:
    """The cache as it was before one pass: the linear layers' states, and what the pass ran."""

    states: dict[int, tuple[dict, dict]]  # layer -> (conv_states, recurrent_states), copies
    run: list[int]  # the tokens the pass ran: pending + its own


@dataclass
class HybridCacheState(CacheState):
    pending: list[int] = field(default_factory=list)  # committed tokens not yet in the cache
    snapshot: Snapshot | None = None


class HybridRunner(Runner):
    """A Runner whose rollback also rewinds the recurrent state of linear-attention layers."""

    @torch.inference_mode()
    def prefill(self, inputs, reads: TargetReads = NO_READS):
        logits, state = super().prefill(inputs, reads)
        return logits, HybridCacheState(**vars(state))

    @torch.inference_mode()
    def extend(self, state: HybridCacheState, token_ids: list[int]) -> torch.Tensor:
        """Run pending + token_ids; returns the logits of token_ids, (n, V)."""
        run = state.pending + token_ids
        # One token can only be kept whole: no snapshot for plain decoding.
        state.snapshot = Snapshot(self._linear_states(state), run) if len(token_ids) > 1 else None
        state.cache_len -= len(state.pending)
        state.rope_pos -= len(state.pending)
        state.pending = []
        logits = super().extend(state, run)
        if state.hidden is not None:
            state.hidden = {layer: rows[-len(token_ids):] for layer, rows in state.hidden.items()}
        return logits[-len(token_ids):]

    def rollback(self, state: CacheState, num_tokens: int) -> None:
        if num_tokens == 0:
            super().rollback(state, 0)  # trims the recorded conv and sliding-window states
            return
        snapshot = state.snapshot
        if snapshot is None or num_tokens >= len(snapshot.run):
            raise RuntimeError(f"cannot roll back {num_tokens} tokens: no snapshot of a pass that long")
        state.cache.crop(-len(snapshot.run))  # attention layers: back to before the pass
        for index, (conv, recurrent) in snapshot.states.items():
            layer = state.cache.layers[index]
            layer.conv_states, layer.recurrent_states = conv, recurrent
        state.pending = snapshot.run[:-num_tokens]
        state.snapshot = None
        state.cache_len -= num_tokens
        state.rope_pos -= num_tokens

    @staticmethod
    def _linear_states(state: CacheState) -> dict[int, tuple[dict, dict]]:
        """Copies of every linear layer's conv and recurrent states (None where not yet set)."""
        def copy(states: dict) -> dict:
            return {i: None if t is None else t.clone() for i, t in states.items()}

        return {index: (copy(layer.conv_states), copy(layer.recurrent_states))
                for index, layer in enumerate(state.cache.layers)
                if isinstance(layer, LinearAttentionCacheLayerMixin)}
