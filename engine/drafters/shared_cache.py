"""Shared-cache assistant: a small model with no KV cache of its own that attends to the target's
K/V (Gemma 4 and its `gemma4_assistant`).

Each draft step is one assistant forward of a single query at the position of the newest
committed token x_T. Its input is the target's embedding of the previous token concatenated
with a hidden state: at the first step of a round the target's last hidden state at T - 1 (the
position whose output chose x_T), then the assistant's own projected state. Its keys and
values are the target's: those of the last full-attention and the last sliding-window layer
that store K/V for sharing, one set per layer type. The query position stays T for the whole
round; the drafted tokens only enter through the chained hidden state and embedding.

Only validated K/V. transformers hands the assistant the K/V of the target's last pass, rejected
draft entries included (cut by length, which on a sliding-window layer is not a cut by
position). Here each pass's shared K/V is kept without the entries of rejected draft tokens:
- full attention: the pass's K/V cover positions 0 .. end - 1; the validated ones are 0 .. T - 1;
- sliding window: the pass's K/V cover only the window before the pass plus the pass, so the
  validated entries are appended to a tail this drafter keeps (the last `2 * window` positions,
  more than the assistant's window mask lets it see), as if the target had kept them all.
"""

from __future__ import annotations

import torch

from engine.drafters.base import Draft
from engine.drafters.target_positions import TargetPositions
from engine.prompt import Prompt
from engine.runner import CacheState
from engine.sampling import Sampler


class SharedCacheDrafter:
    kind = "shared_cache"
    target_layers = (-1,)  # the target's last hidden state
    shares_kv = True

    def __init__(self, name: str, assistant, target_model, family):
        self.name = name
        self.assistant = assistant
        self.target_model = target_model
        self.family = family
        self.vocab_size = target_model.get_output_embeddings().weight.shape[0]
        self.keep_sliding = 2 * assistant.config.get_text_config().sliding_window
        self._reset()

    def _reset(self) -> None:
        self.target: CacheState | None = None
        self.positions: TargetPositions | None = None
        self.kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # layer type -> validated (K, V)
        self.last_hidden: torch.Tensor | None = None  # (H,) target hidden state at T - 1
        self.num_drafted = 0

    @torch.inference_mode()
    def begin(self, prompt: Prompt, target_state: CacheState) -> None:
        self._reset()
        self.target = target_state
        self.positions = TargetPositions(self.family, self.target_model, prompt)
        self._learn(num_validated=len(prompt.input_ids), num_rejected=0)

    @torch.inference_mode()
    def propose(self, generated: list[int], k: int, sampler: Sampler) -> Draft:
        self.num_drafted = max(k, 0)
        if k <= 0:
            return Draft([])
        newest = self.target.cache_len  # T: the target has run x_0 .. x_{T-1}
        position = self.positions(newest, newest + 1).to(self.assistant.device)
        embedding = self.target_model.get_input_embeddings()
        token, hidden = generated[-1], self.last_hidden
        tokens, probs = [], []
        for _ in range(k):
            token_embedding = embedding(torch.tensor([token], device=hidden.device))[0]
            inputs_embeds = torch.cat([token_embedding, hidden.to(token_embedding.dtype)])[None, None]
            out = self.assistant(inputs_embeds=inputs_embeds, position_ids=position, shared_kv_states=self.kv)
            token, token_probs = sampler.next_token(self._vocab(out.logits[0, -1]))
            hidden = out.last_hidden_state[0, -1]
            tokens.append(token)
            probs.append(token_probs)
        return Draft(tokens, None if sampler.settings.greedy else torch.stack(probs))

    def accept(self, num_accepted: int) -> None:
        """The verify pass ran [last, d_1 .. d_k]: its first num_accepted + 1 entries are valid."""
        self._learn(num_validated=num_accepted + 1, num_rejected=self.num_drafted - num_accepted)

    def end(self) -> None:
        self._reset()

    def _learn(self, num_validated: int, num_rejected: int) -> None:
        """Take the validated part of the last target pass: its shared K/V and the hidden state
        of its last validated position."""
        self.last_hidden = self.target.hidden[-1][num_validated - 1]
        for layer_type, (keys, values) in self.target.shared_kv.items():
            keep = keys.shape[-2] - num_rejected  # the rejected drafts are the pass's last entries
            keys, values = keys[..., :keep, :], values[..., :keep, :]
            if layer_type == "sliding_attention":
                keys, values = self._sliding_tail(keys, values, num_validated)
            self.kv[layer_type] = (keys, values)

    def _sliding_tail(self, keys, values, num_validated: int):
        """The validated sliding-window K/V: the kept tail before this pass, then the pass's
        entries (which repeat the tail's last window - 1 positions), cut to `keep_sliding`."""
        if "sliding_attention" in self.kv:
            old_keys, old_values = self.kv["sliding_attention"]
            overlap = keys.shape[-2] - num_validated  # entries of the pass that were in the cache already
            old_end = old_keys.shape[-2] - overlap
            keys = torch.cat([old_keys[..., :old_end, :], keys], dim=-2)
            values = torch.cat([old_values[..., :old_end, :], values], dim=-2)
        return keys[..., -self.keep_sliding:, :], values[..., -self.keep_sliding:, :]

    def _vocab(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[: self.vocab_size].float()
