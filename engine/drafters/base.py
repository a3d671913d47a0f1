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
`DrafterUnavailable(reason)` from `begin` (or `propose`); any exception from any drafter call
hands the rest of the request to plain decoding, with the reason in the statistics, and the
target stops computing what the drafter read. The loop makes every call through one
`GuardedSession`, which owns that policy.

What a reading drafter finds in the target's CacheState (engine/runner.py): after prefill,
`hidden` (one (S, H) per asked layer) and `shared_kv` cover the prompt, and `prompt_positions`
/ `rope_delta` are the prompt's rotary positions; in `accept(num_accepted)` they cover the
verify pass, whose first num_accepted + 1 rows are committed (the last committed token and the
accepted draft tokens).

Trees (engine/tree.py): a session that can branch is a `TreeSession`: it also offers
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

import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from engine.prompt import Prompt
from engine.runner import CacheState, TargetReads
from engine.sampling import Sampler
from engine.stats import Stats


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


@runtime_checkable
class TreeSession(DraftSession, Protocol):
    """A session that can also branch (engine/tree.py; module doc above)."""

    def propose_tree(self, generated: list[int], depth: int, budget: int, branching: int,
                     sampler: Sampler) -> Draft: ...

    def accept(self, num_accepted: int, path: list[int] | None = None) -> None: ...

    def tree_unsupported(self) -> str | None: ...


def tree_fallback_reason(target, state: CacheState, drafter: Drafter, session: DraftSession) -> str | None:
    """Why this request drafts chains although a tree was asked; None when it can draft trees."""
    if not isinstance(session, TreeSession):
        reads = " (it reads the target's pass row by row)" if drafter.reads else ""
        return f"the {drafter.kind} drafter drafts chains only{reads}"
    return target.tree_unsupported(state) or session.tree_unsupported()


class Drafter(Protocol):
    name: str  # what the user picked: a model id or folder, "ngram" or "mtp"
    kind: str  # "text_lm", "vlm", "ngram", "mtp", "dflash", "shared_cache"
    reads: TargetReads  # what each target pass must also compute for it

    def begin(self, prompt: Prompt, target: CacheState) -> DraftSession: ...


class GuardedSession:
    """One request's drafter session behind the fallback policy; the loop makes every drafter
    call through it. When any call raises (`begin`, `propose`, `propose_tree`, `accept`,
    `tree_unsupported`), drafting ends for the rest of the request: `stats.fallback_reason` names
    the call and the error, the target stops computing what the drafter read
    (`state.stop_reading()`), the drafter is not called again, and every later draft is empty,
    so the request decodes plainly. The answer stays exact: a draft is only a proposal that
    the target verifies, and the target's cache never holds more than it verified."""

    def __init__(self, drafter: Drafter | None, state: CacheState, stats: Stats):
        self.drafter, self.state, self.stats = drafter, state, stats
        self.session: DraftSession | None = None  # None: decoding plainly

    def begin(self, prompt: Prompt) -> None:
        """The drafter's own prefill, timed in stats.drafter_prefill_s (none without a drafter)."""
        if self.drafter is not None:
            started = time.perf_counter()
            self.session = self._call("begin", "at prefill", self.drafter.begin, prompt, self.state)
            self.stats.drafter_prefill_s = time.perf_counter() - started

    def tree_unsupported(self, target) -> str | None:
        """Why this request drafts chains although a tree was asked (tree_fallback_reason)."""
        reason = self._call("tree_unsupported", "at prefill", tree_fallback_reason, target, self.state, self.drafter,
                            self.session)
        return reason if self.session is not None else "the drafter failed: decoding plainly"

    def propose(self, generated: list[int], k: int, sampler: Sampler, draft_tree: int = 0, branching: int = 2) -> Draft:
        """Up to k tokens after generated[-1]: a chain, or a tree of up to `draft_tree` nodes; empty
        when decoding plainly."""
        draft = None
        when = f"after {len(generated)} tokens"
        if self.session is not None and draft_tree and k > 0:
            draft = self._call("propose_tree", when, self.session.propose_tree, generated, k, draft_tree, branching,
                               sampler)
        elif self.session is not None:
            draft = self._call("propose", when, self.session.propose, generated, k, sampler)
        return draft if draft is not None else Draft([])

    def accept(self, draft: Draft, path: list[int], generated: list[int]) -> None:
        """The drafter learns the verify pass: the accepted nodes `path` of `draft` (a chain's first
        len(path) tokens); `generated`: the answer before them."""
        if self.session is not None:
            learned = (len(path),) if draft.parents is None else (len(path), path)
            self._call("accept", f"after {len(generated)} tokens", self.session.accept, *learned)

    def _call(self, method: str, when: str, call, *args):
        """call(*args), or None after it raised: then drafting ends for this request."""
        try:
            return call(*args)
        except Exception as error:  # any drafter failure falls back to plain decoding
            reason = f"drafter failed in {method} {when}: {type(error).__name__}: {error}"
            self.stats.fallback_reason = str(error) if isinstance(error, DrafterUnavailable) else reason
            self.session = None
            self.state.stop_reading()
            return None
