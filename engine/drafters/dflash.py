"""DFlash block drafter: a small assistant drafts a whole block in one pass from several of the
target's hidden layers (transformers' `muse_glimmer_assistant`, `speculation_type="dflash"`).

Serves: a `--drafter` folder or hub id whose config names `target_layer_ids` and `block_size`;
it must fit the target (layers it reads exist, same hidden size, mask token in the vocabulary,
the target's kind of rotary positions). Reads from the target: hidden states after each of
`target_layer_ids`.

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
from transformers import AutoModel

from engine.drafters.base import Draft, context_rows, draft_from_rows
from engine.drafters.target_positions import TargetPositions
from engine.prompt import Prompt
from engine.runner import CacheState, TargetReads
from engine.sampling import Sampler
from models.loading import LoadError, LoadOptions, from_pretrained, model_kwargs


def serves(name: str, config) -> bool:
    """A DFlash block drafter's config names the target layers it reads and its block size."""
    return getattr(config, "target_layer_ids", None) is not None and getattr(config, "block_size", None) is not None


def load(name: str, config, target, options: LoadOptions) -> DFlashDrafter:
    text_config = target.model.config.get_text_config()
    problems = []
    if max(config.target_layer_ids) >= text_config.num_hidden_layers:
        problems.append(f"it reads target layers {config.target_layer_ids}, the target has {text_config.num_hidden_layers}")
    if config.hidden_size != text_config.hidden_size:
        problems.append(f"its hidden size is {config.hidden_size}, the target's {text_config.hidden_size}")
    if config.mask_token_id >= target.vocab_size:
        problems.append(f"its mask token {config.mask_token_id} is outside the target's vocabulary of {target.vocab_size}")
    if target.family.positions(0, 1, "cpu").dim() != 2:
        problems.append(f"its rotary embedding is 1-axis, the target ({target.family.name}) numbers positions "
                        "on three M-RoPE rows")
    if problems:
        raise LoadError(f"DFlash drafter {name!r} ({config.model_type}) does not fit the target {target.name!r}: "
                        + "; ".join(problems) + ". Use the assistant trained for this target.")
    assistant = from_pretrained(AutoModel, name, model_kwargs(options))  # the target's dtype: it reads its states
    return DFlashDrafter(name, assistant, target.model, target.family)


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
        self.reads = TargetReads(hidden_layers=self.target_layers)

    @torch.inference_mode()
    def begin(self, prompt: Prompt, target: CacheState) -> DFlashSession:
        return DFlashSession(self, len(prompt.input_ids), target)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's input embeddings, without an embedding norm (as transformers' DFlash does)."""
        embedding = self.target_model.get_input_embeddings()
        if getattr(embedding, "embed_norm", None) is not None:
            return torch.nn.Embedding.forward(embedding, ids)
        return embedding(ids)


class DFlashSession:
    @torch.inference_mode()
    def __init__(self, drafter: DFlashDrafter, num_prompt: int, target: CacheState):
        from transformers.cache_utils import DFlashCache

        self.drafter, self.assistant, self.target_model = drafter, drafter.assistant, drafter.target_model
        self.block_size, self.mask_token_id = drafter.block_size, drafter.mask_token_id
        self.target = target
        self.positions = TargetPositions(drafter.family, target)
        self.cache = DFlashCache(config=self.assistant.config)
        self.cache.activate_past_recording()
        self.context_len = 0  # context entries in the cache (committed positions 0 .. context_len - 1)
        self.new_context = context_rows(target, drafter.target_layers, num_prompt)  # (m, L * H) target rows not yet in the cache
        self.block_in_cache = False

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
            noise_embeds=self.drafter.embed(block_ids)[None],
            context_hidden_states=self.new_context[None].to(self.assistant.dtype),
            position_ids=self.positions(self.context_len, anchor + self.block_size).to(self.assistant.device),
            cache=self.cache,
        ).last_hidden_state[0, 1:]  # (block_size - 1, H): the positions after the anchor
        self.context_len, self.new_context, self.block_in_cache = anchor, None, True
        return draft_from_rows(sampler, self._logits(out[: min(k, self.block_size - 1)]))

    def accept(self, num_accepted: int) -> None:
        """Rows of the last committed token and the accepted drafts become context."""
        rows = context_rows(self.target, self.drafter.target_layers, num_accepted + 1)
        self.new_context = rows if self.new_context is None else torch.cat([self.new_context, rows])

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:
        """(n, V) float32 logits of assistant rows through the target's head."""
        head = self.target_model.get_output_embeddings()
        return head(rows.to(head.weight.dtype)).float()
