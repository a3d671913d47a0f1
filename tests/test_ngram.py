"""The n-gram drafter: the docstring's worked example, and never an image placeholder."""

from __future__ import annotations

import random

from engine.drafters.ngram import NgramDrafter, lookup
from engine.sampling import Sampler, SamplingSettings
from tests.mocks import prompt_of


def test_worked_example_from_the_docstring():
    assert lookup([5, 6, 7, 8, 9, 5, 6, 7], k=3, min_ngram=1, max_ngram=3, blocked=frozenset()) == [8, 9, 5]
    assert lookup([5, 6, 99, 99, 7, 5, 6], k=3, min_ngram=1, max_ngram=3, blocked=frozenset({99})) == []


def test_latest_match_and_longest_ngram_win():
    # [1, 2] occurs twice; the latest occurrence (followed by 4) is used
    assert lookup([1, 2, 3, 1, 2, 4, 1, 2], k=1, min_ngram=1, max_ngram=2, blocked=frozenset()) == [4]
    assert lookup([1, 2, 3], k=2, min_ngram=1, max_ngram=3, blocked=frozenset()) == []


def test_never_proposes_a_placeholder_on_image_heavy_contexts():
    rng = random.Random(0)
    placeholders = frozenset({50, 51, 52})
    sampler = Sampler(SamplingSettings())
    for trial in range(300):
        prompt = [rng.choice([1, 2, 3, 50, 51, 52, 4]) for _ in range(rng.randint(2, 60))]
        drafter = NgramDrafter()
        session = drafter.begin(prompt_of(prompt, placeholders), None)
        answer = [rng.choice([1, 2, 3, 4]) for _ in range(rng.randint(1, 10))]
        draft = session.propose(answer, rng.randint(1, 8), sampler).token_ids
        assert not placeholders & set(draft), (prompt, answer, draft)


def search_whole_context(context: list[int], k: int, max_ngram: int, blocked: frozenset[int]) -> list[int]:
    """The definition, by a search of the whole context: what followed the latest earlier
    occurrence of the longest suffix (of at most max_ngram tokens) that occurred before."""
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == context[-n:]:
                following = context[start + n:start + n + k]
                cut = next((i for i, token in enumerate(following) if token in blocked), len(following))
                return following[:cut]
    return []


def test_a_session_fed_round_by_round_proposes_what_a_search_of_the_whole_context_finds():
    """The session's index grows with the answer's new tokens only; its proposals stay those of
    a search over prompt + answer at every round."""
    rng = random.Random(1)
    sampler = Sampler(SamplingSettings())
    blocked = frozenset({6})
    for trial in range(100):
        prompt = [rng.randint(1, 6) for _ in range(rng.randint(1, 30))]
        session = NgramDrafter().begin(prompt_of(prompt, blocked), None)
        answer: list[int] = []
        for _ in range(rng.randint(1, 30)):
            answer += [rng.randint(1, 5) for _ in range(rng.randint(1, 3))]
            k = rng.randint(1, 6)
            expected = search_whole_context(prompt + answer, k, 3, blocked)
            assert session.propose(answer, k, sampler).token_ids == expected, (prompt, answer, k)
