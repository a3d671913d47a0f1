"""Drafters that are language models: a text-only LM, or a small VLM of the target's family.

Serves: any `--drafter` folder or hub id whose config is a causal LM (kind "text_lm") or a VLM
of the target's family ("vlm"), whose tokenizer gives the target's ids to the tokens they share
(checked at load). Its layers may be attention or, as in every small Qwen3.5, linear attention
(a recurrent state, rolled back by engine/linear_attention_rollback.py's HybridRunner).

Each request's session keeps its own KV cache and positions (a Runner state), prefilled on its
own view of the prompt:
- text-only LM: the conversation without its images, rendered by the drafter's own chat
  template; its positions are consecutive and image tokens never enter its cache.
- VLM: the same messages and images through its own processor and vision tower, with its
  own rope_delta.
The answer tokens are shared ids, so the session feeds the target's committed tokens into its
cache as they come. Rolling back after a rejection: the session keeps the list of answer tokens
its cache holds, and crops to the common prefix with the committed answer before drafting again.
With linear-attention layers a crop cannot rewind the recurrent state: `propose` checkpoints
the cache once it holds the committed answer, before feeding its own draft tokens, and the
rollback returns there, the accepted draft tokens left pending for the next pass (the design
and its cost in engine/linear_attention_rollback.py).

Trees (`propose_tree`, engine/tree.py), as EAGLE-2's beam: depth by depth, one pass over the
`branching` best nodes of the newest depth (a tree mask on the drafter's own cache) gives each
its `branching` most likely next tokens; of all nodes drafted, the `budget` of highest path
probability (the product of the drafter's probabilities from the root) make the tree. Nodes
are the drafter's top choices, not samples, also when sampling (engine/sampling.accept_tree
keeps the target's distribution for such nodes). `accept` keeps the accepted path's entries in
the drafter's cache and drops the other branches. A drafter with linear-attention layers drafts
chains (`tree_unsupported` names why: a tree pass would mix the branches in its recurrent state).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from engine.drafters.base import Draft, DraftBuilder, DrafterUnavailable
from engine.linear_attention_rollback import runner_for
from engine.prompt import Prompt, encode_text, encode_vlm
from engine.runner import NO_READS, CacheState, Runner
from engine.sampling import Sampler
from engine.tree import best_nodes, grow_level, subtree
from models.families import TEXT_LM
from models.loading import (LoadError, LoadOptions, check_vocabularies, drafter_options, family_of, from_pretrained,
                            model_kwargs, processor_of, recurrent_layer_types, small_drafter_dtype, tokenizer_of)


def serves(name: str, config) -> bool:
    return config is not None  # asked last: any other language model


def load(name: str, config, target, options: LoadOptions) -> ModelDrafter:
    unchecked = recurrent_layer_types(config) - {"linear_attention"}
    if unchecked:
        raise LoadError(f"drafter {name!r} has {' and '.join(sorted(unchecked))} layers, a state whose rollback this "
                        "engine has not been checked with; use a drafter with attention or linear-attention layers "
                        "(Qwen3.5), or --drafter ngram")
    kwargs = model_kwargs(drafter_options(options))
    if hasattr(config, "vision_config"):
        family = family_of(config)
        if family.name != target.family.name:
            raise LoadError(f"VLM drafter {name!r} is {family.name}, the target is {target.family.name}; a VLM "
                            "drafter must be of the target's family (or use a text-only LM or --drafter ngram)")
        model = from_pretrained(AutoModelForImageTextToText, name, kwargs)
        encoder = processor_of(name, family, options)
        tokenizer, kind = encoder.tokenizer, "vlm"
    else:
        model = from_pretrained(AutoModelForCausalLM, name, kwargs)
        encoder = tokenizer = tokenizer_of(name, options)
        family, kind = TEXT_LM, "text_lm"
    check_vocabularies(target.tokenizer, tokenizer, name)
    model = small_drafter_dtype(model, options)
    max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    return ModelDrafter(name, kind, runner_for(model, family, target.vocab_size), encoder, max_positions)


class ModelDrafter:
    reads = NO_READS

    def __init__(self, name: str, kind: str, runner: Runner, encoder, max_positions: int | None):
        self.name = name
        self.kind = kind  # "text_lm" or "vlm"
        self.runner = runner
        self.encoder = encoder  # tokenizer (text_lm) or processor (vlm)
        self.max_positions = max_positions

    def begin(self, prompt: Prompt, target: CacheState) -> ModelSession:
        messages = prompt.messages
        inputs = (encode_vlm(self.encoder, self.runner.family, messages, prompt.max_image_tokens) if self.kind == "vlm"
                  else encode_text(self.encoder, messages))
        prompt_len = inputs["input_ids"].shape[1]
        if self.max_positions and prompt_len >= self.max_positions:
            raise DrafterUnavailable(f"prompt of {prompt_len} tokens exceeds the drafter's {self.max_positions} positions")
        blocked = torch.tensor(sorted(prompt.placeholder_ids), dtype=torch.long)
        return ModelSession(self.runner, self.runner.prefill(inputs)[1], blocked)


class ModelSession:
    def __init__(self, runner: Runner, state: CacheState, blocked: torch.Tensor):
        self.runner = runner
        self.state = state  # the drafter's own cache and positions
        self.blocked = blocked  # (P,) ids never proposed: image placeholders
        self.cached_answer: list[int] = []  # answer tokens held in the drafter's cache
        self.verified = 0  # cached_answer[:verified] are committed answer tokens: _sync compares only after them
        self.tree: tuple[list[int], dict[int, int]] = ([], {})  # the last tree: token ids, {node run: tree entry}

    def propose(self, generated: list[int], k: int, sampler: Sampler) -> Draft:
        builder = DraftBuilder(sampler)
        if k <= 0:
            return builder.draft()
        self._sync(generated)
        pending = generated[len(self.cached_answer):]  # committed tokens not yet in the cache
        for step in range(k):
            logits = self.runner.extend(self.state, pending)[-1]  # (V,)
            self.cached_answer += pending
            if step == 0:  # the committed answer only: a rejection of the drafts rolls back to here
                self.verified = len(self.cached_answer)
                if k > 1:
                    self.runner.checkpoint(self.state)
            pending = [builder.sample(logits.index_fill(0, self.blocked.to(logits.device), float("-inf")))]
        # The last drafted token is not fed: if accepted, the next propose feeds it.
        return builder.draft()

    @torch.inference_mode()
    def propose_tree(self, generated: list[int], depth: int, budget: int, branching: int, sampler: Sampler) -> Draft:
        self._sync(generated)
        pending = generated[len(self.cached_answer):]
        logits = self.runner.extend(self.state, pending)[-1:]  # (1, V): after the root
        self.cached_answer += pending
        self.verified = len(self.cached_answer)
        token_ids, parents, scores = [], [], []
        beam = [-1]  # the nodes whose next-token logits are the rows of `logits` (-1: the root)
        run: list[int] = []  # the nodes run, in the order of the drafter's tree entries
        for level in range(depth):
            beam = grow_level(beam, self._probs(logits, sampler).topk(branching, dim=-1), branching,
                              token_ids, parents, scores)
            if level == depth - 1 or not beam:
                break
            entries = [run.index(parents[i]) if parents[i] >= 0 else -1 for i in beam]
            logits = self.runner.extend_tree(self.state, [token_ids[i] for i in beam], entries)
            run += beam
        kept = best_nodes(parents, scores, budget)
        token_ids, parents = subtree(token_ids, parents, kept)
        self.tree = (token_ids, {kept.index(node): entry for entry, node in enumerate(run) if node in kept})
        return Draft(token_ids, parents=parents)

    def accept(self, num_accepted: int, path: list[int] | None = None) -> None:
        """A chain: nothing to do now, the next propose crops the cache to what the target
        committed. A tree: keep the entries of the accepted path's nodes the drafter ran (a
        prefix of it), drop the other entries."""
        if path is None:
            return
        token_ids, entries = self.tree
        kept = path[:next((i for i, node in enumerate(path) if node not in entries), len(path))]
        self.runner.keep_path(self.state, [entries[node] for node in kept])
        self.cached_answer += [token_ids[node] for node in kept]  # accepted: committed tokens
        self.verified = len(self.cached_answer)

    def tree_unsupported(self) -> str | None:
        return self.runner.tree_unsupported(self.state)

    def _probs(self, logits: torch.Tensor, sampler: Sampler) -> torch.Tensor:
        """(n, V) the drafter's next-token probabilities, image placeholders excluded."""
        logits = logits.index_fill(-1, self.blocked.to(logits.device), float("-inf"))
        return logits.softmax(-1) if sampler.settings.greedy else sampler.probs(logits)

    def _sync(self, generated: list[int]) -> None:
        """Crop the cache to the longest prefix of the answer that it holds correctly (never the whole
        answer: its last token is fed again). Only the
        entries after `verified` can differ (the drafts fed last round: at most k), so a round
        reads O(k) tokens of the answer, not all of it."""
        if self.state.tree_parents:  # a tree that no accept settled (the request fell back)
            self.runner.keep_path(self.state, [])
        # At most all but the answer's last token: propose feeds at least that one, for its logits (the
        # cache can hold all of the answer when the drafts the target judged were not the ones fed here).
        common, end = self.verified, min(len(self.cached_answer), len(generated) - 1)
        while common < end and self.cached_answer[common] == generated[common]:
            common += 1
        self.runner.rollback(self.state, len(self.cached_answer) - common)
        del self.cached_answer[common:]
        self.verified = common
