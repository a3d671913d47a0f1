"""Shared-cache assistant: a small model with no KV cache of its own that attends to the target's
K/V (Gemma 4 and its `gemma4_assistant`).

Serves: a `--drafter` folder or hub id whose config names `backbone_hidden_size`; it must fit
the target (a target that shares K/V between layers, of that hidden size, and a vocabulary at
least the target's). Reads from the target: the last hidden state and the shared K/V.

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
from transformers import AutoModelForCausalLM

from engine.drafters.base import Draft, DraftBuilder
from engine.drafters.target_positions import TargetPositions
from engine.prompt import Prompt
from engine.runner import CacheState, TargetReads
from engine.sampling import Sampler
from models.loading import LoadError, LoadOptions, from_pretrained, model_kwargs


def serves(name: str, config) -> bool:
    """An assistant that attends to the target's shared K/V names the target's hidden size."""
    return getattr(config, "backbone_hidden_size", None) is not None


def load(name: str, config, target, options: LoadOptions) -> SharedCacheDrafter:
    text_config = target.model.config.get_text_config()
    stores = set(getattr(text_config, "kv_sharing_modes", None) or ())
    problems = []
    if "store" not in stores:
        problems.append(f"the target ({target.family.name}) shares no K/V between layers")
    if config.backbone_hidden_size != text_config.hidden_size:
        problems.append(f"it was trained on a target of hidden size {config.backbone_hidden_size}, "
                        f"the target's is {text_config.hidden_size}")
    if config.get_text_config().vocab_size < target.vocab_size:
        problems.append(f"its vocabulary ({config.get_text_config().vocab_size}) is smaller than the target's")
    if problems:
        raise LoadError(f"assistant {name!r} ({config.model_type}) does not fit the target {target.name!r}: "
                        + "; ".join(problems) + ". Use the assistant released with this target.")
    assistant = from_pretrained(AutoModelForCausalLM, name, model_kwargs(options))  # the target's dtype
    return SharedCacheDrafter(name, assistant, target.model, target.family)


class SharedCacheDrafter:
    kind = "shared_cache"
    reads = TargetReads(hidden_layers=(-1,), shared_kv=True)  # the target's last hidden state, its shared K/V

    def __init__(self, name: str, assistant, target_model, family):
        self.name = name
        self.assistant = assistant
        self.target_model = target_model
        self.family = family
        self.vocab_size = target_model.get_output_embeddings().weight.shape[0]
        self.keep_sliding = 2 * assistant.config.get_text_config().sliding_window

    @torch.inference_mode()
    def begin(self, prompt: Prompt, target: CacheState) -> SharedCacheSession:
        return SharedCacheSession(self, len(prompt.input_ids), target)


class SharedCacheSession:
    @torch.inference_mode()
    def __init__(self, drafter: SharedCacheDrafter, num_prompt: int, target: CacheState):
        self.assistant, self.target_model = drafter.assistant, drafter.target_model
        self.vocab_size, self.keep_sliding = drafter.vocab_size, drafter.keep_sliding
        self.target = target
        self.positions = TargetPositions(drafter.family, target)
        self.kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # layer type -> validated (K, V)
        self.last_hidden: torch.Tensor | None = None  # (H,) target hidden state at T - 1
        self.num_drafted = 0
        self._learn(num_validated=num_prompt, num_rejected=0)

    @torch.inference_mode()
    def propose(self, generated: list[int], k: int, sampler: Sampler) -> Draft:
        self.num_drafted = max(k, 0)
        if k <= 0:
            return Draft([])
        newest = self.target.cache_len  # T: the target has run x_0 .. x_{T-1}
        position = self.positions(newest, newest + 1).to(self.assistant.device)
        embedding = self.target_model.get_input_embeddings()
        token, hidden = generated[-1], self.last_hidden
        builder = DraftBuilder(sampler)
        for _ in range(k):
            token_embedding = embedding(torch.tensor([token], device=hidden.device))[0]
            inputs_embeds = torch.cat([token_embedding, hidden.to(token_embedding.dtype)])[None, None]
            out = self.assistant(inputs_embeds=inputs_embeds, position_ids=position, shared_kv_states=self.kv)
            token = builder.sample(self._vocab(out.logits[0, -1]))
            hidden = out.last_hidden_state[0, -1]
        return builder.draft()

    def accept(self, num_accepted: int) -> None:
        """The verify pass ran [last, d_1 .. d_k]: its first num_accepted + 1 entries are valid."""
        self._learn(num_validated=num_accepted + 1, num_rejected=self.num_drafted - num_accepted)

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
