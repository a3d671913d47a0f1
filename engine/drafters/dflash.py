"""DFlash block drafter: a small assistant drafts a whole block in one pass from several of the
target's hidden layers (transformers' `muse_glimmer_assistant`, `speculation_type="dflash"`).

The assistant's KV cache holds one *context* entry per committed token: the target's hidden
states at `target_layer_ids` (concatenated, projected by the assistant's encoder). Each round
it appends the context rows the target produced since the last round, then runs one block of
`block_size` queries: the newest committed token (the anchor) and block_size - 1 mask tokens.
The queries attend to all context and to each other; the outputs after the anchor, through the
target's head, are the draft: up to block_size - 1 tokens from one forward. The block's own
entries are evicted before the next round, so the cache never holds anything a rejection
must undo: rolling back is only "append the rows of the accepted tokens".

With committed tokens x_0 .. x_T the target has run x_0 .. x_{T-1}, so the context covers
positions 0 .. T-1 (the prompt's image positions included: they come from the target's prefill)
and the block sits at positions T .. T + block_size - 1, all the target's own positions.
"""

from __future__ import annotations

import torch

from engine.drafters.base import Draft
from engine.drafters.target_positions import TargetPositions
from engine.prompt import Prompt
from engine.runner import CacheState
from engine.sampling import Sampler


class DFlashDrafter:
    kind = "dflash"

    def __init__(self, name: str, assistant, target_model, family):
        """assistant: e.g. MuseGlimmerAssistantModel; its config names target_layer_ids,
        block_size and mask_token_id."""
        self.name = name
        self.assistant = assistant
        self.target_model = target_model
        self.family = family
        config = assistant.config
        self.block_size = config.block_size
        self.mask_token_id = config.mask_token_id
        self.target_layers = tuple(i + 1 for i in config.target_layer_ids)  # hidden_states[0] = embeddings
        self._reset()

    def _reset(self) -> None:
        self.target: CacheState | None = None
        self.positions: TargetPositions | None = None
        self.cache = None
        self.context_len = 0  # context entries in the cache (committed positions 0 .. context_len - 1)
        self.new_context: torch.Tensor | None = None  # (m, L * H) target rows not yet in the cache
        self.block_in_cache = False

    @torch.inference_mode()
    def begin(self, prompt: Prompt, target_state: CacheState) -> None:
        from transformers.cache_utils import DFlashCache

        self._reset()
        self.target = target_state
        self.positions = TargetPositions(self.family, self.target_model, prompt)
        self.cache = DFlashCache(config=self.assistant.config)
        self.cache.activate_past_recording()
        self.new_context = self._context_rows(len(prompt.input_ids))

    @torch.inference_mode()
    def propose(self, generated: list[int], k: int, sampler: Sampler) -> Draft:
        if k <= 0:
            return Draft([])
        anchor = self.context_len + len(self.new_context)  # T: index of the newest committed token
        if self.block_in_cache:
            self.cache.crop(-self.block_size)  # evict the previous round's block
        self.cache.set_previous_accepted_tokens(len(self.new_context))
        block_ids = torch.tensor([generated[-1]] + [self.mask_token_id] * (self.block_size - 1),
                                 device=self.assistant.device)
        out = self.assistant(
            noise_embeds=self._embed(block_ids)[None],
            context_hidden_states=self.new_context[None].to(self.assistant.dtype),
            position_ids=self.positions(self.context_len, anchor + self.block_size).to(self.assistant.device),
            cache=self.cache,
        ).last_hidden_state[0, 1:]  # (block_size - 1, H): the positions after the anchor
        self.context_len, self.new_context, self.block_in_cache = anchor, None, True
        logits = self._logits(out[: min(k, self.block_size - 1)])
        tokens, probs = [], []
        for row in logits:
            token, token_probs = sampler.next_token(row)
            tokens.append(token)
            probs.append(token_probs)
        return Draft(tokens, None if sampler.settings.greedy else torch.stack(probs))

    def accept(self, num_accepted: int) -> None:
        """Rows of the last committed token and the accepted drafts become context."""
        rows = self._context_rows(num_accepted + 1)
        self.new_context = rows if self.new_context is None else torch.cat([self.new_context, rows])

    def end(self) -> None:
        self._reset()

    def _context_rows(self, num_rows: int) -> torch.Tensor:
        """(num_rows, L * H) the first rows of the target's last pass, its target layers concatenated."""
        return torch.cat([self.target.hidden[layer][:num_rows] for layer in self.target_layers], dim=-1)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's input embeddings, without an embedding norm (as transformers' DFlash does)."""
        embedding = self.target_model.get_input_embeddings()
        if getattr(embedding, "embed_norm", None) is not None:
            return torch.nn.Embedding.forward(embedding, ids)
        return embedding(ids)

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:
        """(n, V) float32 logits of assistant rows through the target's head."""
        head = self.target_model.get_output_embeddings()
        return head(rows.to(head.weight.dtype)).float()
