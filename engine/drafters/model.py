"""Drafters that are language models: a text-only LM, or a small VLM of the target's family.

Both keep their own KV cache and positions (a Runner), prefilled on their own view of the
prompt:
- text-only LM: the conversation without its images, rendered by the drafter's own chat
  template; its positions are consecutive and image tokens never enter its cache.
- VLM: the same messages and images through its own processor and vision tower, with its
  own rope_delta.
The answer tokens are shared ids (checked at load time), so the drafter feeds the target's
committed tokens into its cache as they come. Rolling back after a rejection: the drafter
keeps the list of answer tokens its cache holds, and crops to the common prefix with the
committed answer before drafting again.
"""

from __future__ import annotations

import torch

from engine.drafters.base import Draft, DrafterUnavailable
from engine.prompt import Prompt, encode_text, encode_vlm
from engine.runner import CacheState, Runner
from engine.sampling import Sampler


class ModelDrafter:
    def __init__(self, name: str, kind: str, runner: Runner, encoder, max_positions: int | None):
        self.name = name
        self.kind = kind  # "text_lm" or "vlm"
        self.runner = runner
        self.encoder = encoder  # tokenizer (text_lm) or processor (vlm)
        self.max_positions = max_positions
        self.state: CacheState | None = None
        self.cached_answer: list[int] = []  # answer tokens held in the drafter's cache
        self.blocked: torch.Tensor | None = None  # (P,) ids never proposed: image placeholders

    def begin(self, prompt: Prompt) -> None:
        messages = prompt.messages
        inputs = encode_vlm(self.encoder, messages) if self.kind == "vlm" else encode_text(self.encoder, messages)
        prompt_len = inputs["input_ids"].shape[1]
        if self.max_positions and prompt_len >= self.max_positions:
            raise DrafterUnavailable(f"prompt of {prompt_len} tokens exceeds the drafter's {self.max_positions} positions")
        self.blocked = torch.tensor(sorted(prompt.placeholder_ids), dtype=torch.long)
        self.state = self.runner.prefill(inputs)[1]
        self.cached_answer = []

    def propose(self, generated: list[int], k: int, sampler: Sampler) -> Draft:
        if k <= 0:
            return Draft([])
        self._sync(generated)
        pending = generated[len(self.cached_answer):]  # committed tokens not yet in the cache
        tokens, probs = [], []
        for _ in range(k):
            logits = self.runner.extend(self.state, pending)[-1]  # (V,)
            self.cached_answer += pending
            logits = logits.index_fill(0, self.blocked.to(logits.device), float("-inf"))
            token, token_probs = sampler.next_token(logits)
            tokens.append(token)
            probs.append(token_probs)
            pending = [token]
        # The last drafted token is not fed: if accepted, the next propose feeds it.
        return Draft(tokens, None if sampler.settings.greedy else torch.stack(probs))

    def accept(self, num_accepted: int) -> None:
        """Nothing to do now: the next propose crops the cache to what the target committed."""

    def end(self) -> None:
        self.state = None
        self.cached_answer = []

    def _sync(self, generated: list[int]) -> None:
        """Crop the cache to the longest prefix of the answer that it holds correctly."""
        common = 0
        for cached, committed in zip(self.cached_answer, generated):
            if cached != committed:
                break
            common += 1
        self.runner.rollback(self.state, len(self.cached_answer) - common)
        self.cached_answer = self.cached_answer[:common]
