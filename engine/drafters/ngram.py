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
"""

from __future__ import annotations

from engine.drafters.base import Draft
from engine.prompt import Prompt
from engine.runner import NO_READS, CacheState
from engine.sampling import Sampler

KEYWORD = "ngram"


def serves(name: str, config) -> bool:
    return name == KEYWORD


def load(name: str, config, target, options) -> NgramDrafter:
    return NgramDrafter()


def lookup(context: list[int], k: int, min_ngram: int, max_ngram: int, blocked: frozenset[int]) -> list[int]:
    """Up to k tokens that followed the latest earlier match of context's last n tokens."""
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):  # latest earlier occurrence first
            if context[start:start + n] == suffix:
                proposal = []
                for token in context[start + n:start + n + k]:
                    if token in blocked:
                        break
                    proposal.append(token)
                return proposal
    return []


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
        self.drafter = drafter
        self.prompt_ids = prompt_ids
        self.blocked = blocked

    def propose(self, generated: list[int], k: int, sampler: Sampler) -> Draft:
        if k <= 0:
            return Draft([])
        d = self.drafter
        return Draft(lookup(self.prompt_ids + generated, k, d.min_ngram, d.max_ngram, self.blocked))

    def accept(self, num_accepted: int) -> None:
        pass
