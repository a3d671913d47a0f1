"""Models with linear-attention layers (Qwen3.5): rolling back a recurrent state.

A linear-attention layer keeps no per-token cache that a rollback could crop: it keeps a
convolution state (the last few inputs) and a recurrent state that every token folds into.
After a pass over draft tokens the state holds all of them, accepted or not.

Rollback here = snapshot and replay, with the replay folded into the next pass:
- `checkpoint`, called while the cache holds committed tokens only, copies the linear layers'
  states (a snapshot); every later pass adds the tokens it runs to the snapshot's `run`;
- `rollback(n)` after a partial acceptance puts the whole cache back to the snapshot (the
  attention layers are cropped to the same point) and remembers the kept tokens of the run
  as *pending*: committed, but not in the cache;
- the next `extend` runs pending + its own tokens in one pass and returns the logits (and hidden
  states) of its own tokens only.
Any rollback, 0 tokens included, settles the snapshot; plain decoding takes none. A rejection
costs a copy of the recurrent states and a few extra rows in the next pass, never an extra
forward. `cache_len` and `rope_pos` count the pending tokens: they describe the committed
sequence, as for any other model.

Who checkpoints:
- the target's verify pass (engine/tree.py `verify`), before a pass with a draft: the run is
  [last, d1 .. dk], one pass;
- a model drafter's session (engine/drafters/language_model.py), after the first pass of `propose` (the
  committed tokens it had not seen) and before it feeds its own draft tokens one pass each: the
  run is [d1 .. d(k-1)] over k - 1 passes, and after the target accepts d1 .. da they are
  pending, run in front of the next `propose`'s first pass. One copy a round: a snapshot per
  draft token would save those a replayed rows, a few rows in a pass that runs anyway, at the
  price of k - 1 copies a round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from engine.runner import CacheState, Runner
from engine.tree import Pass
from models.families import Family
from models.loading import has_linear_attention


@dataclass
class Snapshot:
    """The cache at a checkpoint: the linear layers' states, and the tokens run since."""

    states: dict[int, tuple[dict, dict]]  # layer -> (conv_states, recurrent_states), copies
    run: list[int] = field(default_factory=list)  # every token run since: pending ones, then each pass's own


@dataclass
class HybridCacheState(CacheState):
    pending: list[int] = field(default_factory=list)  # committed tokens not yet in the cache
    snapshot: Snapshot | None = None


class HybridRunner(Runner):
    """A Runner whose rollback also rewinds the recurrent state of linear-attention layers."""

    state_type = HybridCacheState

    def checkpoint(self, state: HybridCacheState) -> None:
        """Copy the linear layers' states: until the next rollback, one can return to here."""
        state.snapshot = Snapshot(self._linear_states(state))

    @torch.inference_mode()
    def run(self, passes: list[Pass]) -> list[torch.Tensor]:
        """Each pass (a chain: this cache takes no tree) runs pending + its tokens, alone; returns the logits
        of its tokens, (n, V)."""
        logits = []
        for one in passes:
            state, token_ids = one.state, one.token_ids
            if one.parents is not None:
                raise ValueError("a cache with linear-attention layers takes no draft tree")
            run = state.pending + token_ids
            if state.snapshot is not None:
                state.snapshot.run += run
            state.cache_len -= len(state.pending)
            state.rope_pos -= len(state.pending)
            state.pending = []
            (out,) = super().run([Pass(state, run)])
            if state.hidden is not None:
                state.hidden = {layer: rows[-len(token_ids):] for layer, rows in state.hidden.items()}
            logits.append(out[-len(token_ids):])
        return logits

    def rollback(self, state: HybridCacheState, num_tokens: int) -> None:
        snapshot, state.snapshot = state.snapshot, None
        if num_tokens == 0:
            super().rollback(state, 0)  # trims the recorded conv and sliding-window states
            return
        if snapshot is None or num_tokens > len(snapshot.run):
            raise RuntimeError(f"cannot roll back {num_tokens} tokens: no checkpoint that many tokens back")
        state.cache.crop(-len(snapshot.run))  # attention layers: back to the checkpoint
        for index, (conv, recurrent) in snapshot.states.items():
            layer = state.cache.layers[index]
            layer.conv_states, layer.recurrent_states = conv, recurrent
        state.pending = snapshot.run[:len(snapshot.run) - num_tokens]
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


def runner_for(model, family: Family, vocab_size: int | None = None) -> Runner:
    """The Runner for `model`: a HybridRunner when it has linear-attention layers."""
    runner = HybridRunner if has_linear_attention(model.config) else Runner
    return runner(model, family, vocab_size)
