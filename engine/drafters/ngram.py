"""N-gram prompt lookup: propose what followed the last few tokens earlier in the context.

Serves: `--drafter ngram`, with any target (no model, nothing read from the target).

The context is the target's prompt ids followed by the answer so far. The drafter looks for
the most recent earlier occurrence of the context's last n tokens (n from `max_ngram` down
to `min_ngram`) and proposes the up-to-k tokens that followed it. A proposal stops before
any image placeholder or marker id: those ids stand for pixels, and drafting them would put
an image token with no image into the target's input.

Worked example (asserted in tests/test_ngram.py), max_ngram=3, k=3, no placeholders:
    context = [5, 6, 7, 8, 9, 5, 6, 7]   last 3 tokens [5, 6, 7] occur at 0..2
    proposal = [8, 9, 5]                 the 3 tokens that followed them
With an image placeholder 99: context = [5, 6, 99, 99, 7, 5, 6] proposes [] for k=3 after
matching [5, 6] at 0..1 (the next token, 99, is a placeholder).

A session keeps an index of where each n-gram starts (`NgramIndex`) and adds the answer's new
tokens to it each round, so a round costs O(new tokens + k), whatever the context's length.

A tree (`propose_tree`, engine/tree.py) holds the continuations of the longest n-gram that
matches (its latest MAX_MATCHES occurrences), latest first, deduplicated into a trie (at most `branching` children a node); with more
nodes than the budget it keeps those the most continuations pass through, shallower first.
Worked example (asserted in tests/test_tree.py), max_ngram=2, k=3, budget 4:
    context = [5, 6, 7, 5, 6, 8, 5, 6]   [5, 6] occurs at 3..4 and at 0..1
    continuations [8, 5, 6], [7, 5, 6]   one each: the shallower nodes win
    tree token_ids [8, 5, 7, 5], parents [-1, 0, -1, 2]
"""

from __future__ import annotations

from engine.drafters.base import Draft
from engine.prompt import Prompt
from engine.runner import NO_READS, CacheState
from engine.sampling import Sampler
from engine.tree import best_nodes, subtree

KEYWORD = "ngram"
MAX_MATCHES = 32  # occurrences a tree is built from, the latest ones


def serves(name: str, config) -> bool:
    return name == KEYWORD


def load(name: str, config, target, options) -> NgramDrafter:
    return NgramDrafter()


class NgramIndex:
    """A growing context and where each of its n-grams (min_ngram <= n <= max_ngram) starts,
    counting only the n-grams that some token follows; `extend` costs O(new tokens * n-grams)."""

    def __init__(self, min_ngram: int, max_ngram: int):
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.context: list[int] = []
        self.starts: dict[tuple[int, ...], list[int]] = {}  # n-gram -> its starts, increasing

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            end = len(self.context)  # the n-grams ending just before the new token are now followed
            self.context.append(token)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self.starts.setdefault(tuple(self.context[end - n:end]), []).append(end - n)

    def continuations(self, k: int, blocked: frozenset[int], max_matches: int) -> list[list[int]]:
        """What followed the latest `max_matches` earlier occurrences of the context's last n tokens
        (up to k tokens each, cut before a blocked id), latest first, for the longest n that matches."""
        context = self.context
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            starts = self.starts.get(tuple(context[-n:]))
            if starts:
                return [self._following(start + n, k, blocked) for start in reversed(starts[-max_matches:])]
        return []

    def _following(self, first: int, k: int, blocked: frozenset[int]) -> list[int]:
        proposal = []
        for token in self.context[first:first + k]:
            if token in blocked:
                break
            proposal.append(token)
        return proposal


def lookup(context: list[int], k: int, min_ngram: int, max_ngram: int, blocked: frozenset[int]) -> list[int]:
    """Up to k tokens that followed the latest earlier match of context's last n tokens."""
    return next(iter(lookup_all(context, k, min_ngram, max_ngram, blocked, max_matches=1)), [])


def lookup_all(context: list[int], k: int, min_ngram: int, max_ngram: int, blocked: frozenset[int],
               max_matches: int = MAX_MATCHES) -> list[list[int]]:
    """What followed each earlier match of context's last n tokens (up to k tokens each), latest
    match first, for the longest n that matches at all (NgramIndex.continuations)."""
    index = NgramIndex(min_ngram, max_ngram)
    index.extend(context)
    return index.continuations(k, blocked, max_matches)


def trie(continuations: list[list[int]], budget: int, branching: int) -> Draft:
    """The continuations deduplicated into a tree; the `budget` nodes most of them pass through."""
    token_ids: list[int] = []
    parents: list[int] = []
    counts: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for continuation in continuations:
        parent = -1
        for token in continuation:
            node = children.get((parent, token))
            if node is None:
                if sum(1 for p in parents if p == parent) >= branching:
                    break
                node = children[parent, token] = len(token_ids)
                token_ids.append(token)
                parents.append(parent)
                counts.append(0)
            counts[node] += 1
            parent = node
    token_ids, parents = subtree(token_ids, parents, best_nodes(parents, counts, budget))
    return Draft(token_ids, parents=parents) if token_ids else Draft([])


class NgramDrafter:
    kind = "ngram"
    reads = NO_READS

    def __init__(self, name: str = KEYWORD, min_ngram: int = 1, max_ngram: int = 3):
        self.name = name
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram

    def begin(self, prompt: Prompt, target: CacheState) -> NgramSession:
        return NgramSession(self, prompt.input_ids, prompt.placeholder_ids)


class NgramSession:
    def __init__(self, drafter: NgramDrafter, prompt_ids: list[int], blocked: frozenset[int]):
        self.index = NgramIndex(drafter.min_ngram, drafter.max_ngram)
        self.index.extend(prompt_ids)
        self.num_prompt = len(prompt_ids)
        self.blocked = blocked

    def propose(self, generated: list[int], k: int, sampler: Sampler) -> Draft:
        if k <= 0:
            return Draft([])
        self._add(generated)
        return Draft(next(iter(self.index.continuations(k, self.blocked, max_matches=1)), []))

    def propose_tree(self, generated: list[int], depth: int, budget: int, branching: int, sampler: Sampler) -> Draft:
        self._add(generated)
        return trie(self.index.continuations(depth, self.blocked, MAX_MATCHES), budget, branching)

    def _add(self, generated: list[int]) -> None:
        """The answer's tokens the index has not seen yet (the answer only grows)."""
        self.index.extend(generated[len(self.index.context) - self.num_prompt:])

    def accept(self, num_accepted: int, path: list[int] | None = None) -> None:
        pass

    def tree_unsupported(self) -> str | None:
        return None
