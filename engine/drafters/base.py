"""The one contract every drafter follows, in the style of llama.cpp's begin / draft / accept.

A `Drafter` is loaded once and shared by every request: weights, tokenizer, configuration, and
`reads`, what it needs from each pass of the target (TargetReads: hidden layers, shared K/V;
nothing for text, VLM and n-gram drafters). It holds no per-request state. Each request gets
its own `DraftSession` from `begin`, and drops it when the request ends:

    state = target.prefill(prompt, drafter.reads)     # the target keeps what the drafter reads
    session = drafter.begin(prompt, state)            # the drafter's own prefill
    loop:
        draft = session.propose(generated, k, sampler)   # up to k tokens after generated[-1]
        ... the target verifies [generated[-1]] + draft in one pass ...
        session.accept(num_accepted)                  # how many of the draft the target kept

`generated` is the whole answer so far (committed tokens only). An empty draft is a valid
answer: the loop then decodes one token plainly. A drafter that cannot serve a request raises
`DrafterUnavailable(reason)` from `begin` (or `propose`); any exception from a drafter hands
the rest of the request to plain decoding, with the reason in the statistics, and the target
stops computing what the drafter read.

What a reading drafter finds in the target's CacheState (engine/runner.py): after prefill,
`hidden` (one (S, H) per asked layer) and `shared_kv` cover the prompt, and `prompt_positions`
/ `rope_delta` are the prompt's rotary positions; in `accept(num_accepted)` they cover the
verify pass, whose first num_accepted + 1 rows are committed (the last committed token and the
accepted draft tokens).

Trees (engine/tree.py): a session that can branch also offers
`propose_tree(generated, depth, budget, branching, sampler)`, a Draft with `parents`: up to
`budget` nodes, none deeper than `depth`, at most `branching` children per node, and then
takes `accept(num_accepted, path)`, the accepted nodes, to follow that branch;
`tree_unsupported()` says why it cannot branch for this request (None when it can). A chain
draft is always accepted with `accept(num_accepted)`.

Loading: each drafter file says which `--drafter` values it serves (`serves(name, config)`)
and loads them with its own fit checks (`load(name, config, target, options)`); the registry
(engine/drafters/registry.py) asks them in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.prompt import Prompt
from engine.runner import CacheState, TargetReads
from engine.sampling import Sampler


class DrafterUnavailable(Exception):
    """The drafter has no usable context for this request; the request decodes plainly."""


@dataclass
class Draft:
    token_ids: list[int]  # (k,) a chain, or the nodes of a tree
    probs: torch.Tensor | None = None  # (k, V) the distributions sampled from; None = deterministic
    parents: list[int] | None = None  # (k,) a tree: each node's parent, -1 = the last committed token; None = a chain


@dataclass
class DraftBuilder:
    """Samples a draft row by row: `sample(logits)` draws one token (the drafter may feed it back
    before the next row), `draft()` returns the Draft with the distributions when sampling."""

    sampler: Sampler
    token_ids: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)

    def sample(self, logits: torch.Tensor) -> int:
        """One draft token from logits (V,)."""
        token, token_probs = self.sampler.next_token(logits)
        self.token_ids.append(token)
        self.probs.append(token_probs)
        return token

    def draft(self) -> Draft:
        greedy = self.sampler.settings.greedy or not self.token_ids
        return Draft(self.token_ids, None if greedy else torch.stack(self.probs))


def draft_from_rows(sampler: Sampler, logits: torch.Tensor) -> Draft:
    """A draft with one token sampled from each row of logits (n, V), none fed back (a block)."""
    builder = DraftBuilder(sampler)
    for row in logits:
        builder.sample(row)
    return builder.draft()


class DraftSession(Protocol):
    """One request's drafter state, made by `Drafter.begin` and dropped with the request."""

    def propose(self, generated: list[int], k: int, sampler: Sampler) -> Draft: ...

    def accept(self, num_accepted: int) -> None: ...


class Drafter(Protocol):
    name: str  # what the user picked: a model id or folder, "ngram" or "mtp"
    kind: str  # "text_lm", "vlm", "ngram", "mtp", "dflash", "shared_cache"
    reads: TargetReads  # what each target pass must also compute for it

    def begin(self, prompt: Prompt, target: CacheState) -> DraftSession: ...
