"""The A/B verdict (engine/ab.py) is derived from the measured figures and never contradicts them:
sides with chosen statistics, compared as the A/B compares them."""

from __future__ import annotations

import random
import re

import pytest

from engine.ab import Side, compare
from engine.stats import PAUSED, Stats
from tests.mocks import CharTokenizer


def side(mode: str, decode_s: float, forwards: int, decode_tokens: int, drafted: int = 0, accepted: int = 0,
         total_s: float | None = None, ids=(1, 2, 3), reason: str | None = None) -> Side:
    stats = Stats(mode=mode, drafter="d" if mode == "speculative" else None, decode_s=decode_s,
                  decode_tokens=decode_tokens, decode_tok_s=decode_tokens / decode_s, target_forwards=forwards,
                  tokens_per_forward=decode_tokens / forwards, drafted=drafted, accepted=accepted,
                  acceptance=accepted / drafted if drafted else None, total_s=total_s or decode_s + 0.1,
                  draft_length_reason=reason)
    return Side(mode, token_ids=list(ids), done=True, stats=stats)


PLAIN = side("plain", decode_s=10.0, forwards=100, decode_tokens=100, total_s=10.5)


def test_issue_25_slower_decode_faster_answer_at_temperature_0():
    """The A/B that said "too few to pay for drafting (sampling at temperature > 0 ...; the small
    VLM drafter is accepted most often)" at temperature 0 with the VLM drafter, beside "whole
    answer 1.17x as fast": the verdict now rests on the figures, and names the whole answer's."""
    speculative = side("speculative", decode_s=12.0, forwards=60, decode_tokens=100, drafted=50, accepted=40,
                       total_s=9.0)
    result = compare(CharTokenizer(), PLAIN, speculative, temperature=0.0)
    text = result.verdict.text
    assert result.decode_speedup == pytest.approx(0.833, abs=1e-3) and "slower than plain" in text
    assert "temperature" not in text and "VLM" not in text
    assert f"acceptance {speculative.stats.acceptance:.0%}" in text  # the table's figure, same definition
    assert "1.17× as fast" in text  # the whole answer's ratio, which points the other way
    assert "identical" in text


def test_the_verdict_is_the_arithmetic_of_its_table():
    """Speedup = tokens per target pass / a round's time in plain steps, for any figures."""
    rng = random.Random(5)
    for _ in range(200):
        forwards = rng.randint(1, 100)
        decode_tokens = forwards + rng.randint(0, 4 * forwards)
        speculative = side("speculative", decode_s=rng.uniform(0.5, 30), forwards=forwards,
                           decode_tokens=decode_tokens, drafted=decode_tokens, accepted=decode_tokens - forwards)
        result = compare(CharTokenizer(), PLAIN, speculative)
        verdict, speedup = result.verdict, result.decode_speedup
        assert verdict.round_cost and speculative.stats.tokens_per_forward / verdict.round_cost == pytest.approx(speedup)
        tokens, rounds, quoted = map(float, re.search(r"([\d.]+) / ([\d.]+) = ([\d.]+)×", verdict.text).groups())
        assert quoted == float(f"{speedup:.2f}")
        assert ("faster than" in verdict.headline) == (speedup >= 1.05)
        assert ("slower than" in verdict.headline) == (speedup <= 0.95)


def test_paused_drafting_and_a_busy_machine_are_named():
    speculative = side("speculative", decode_s=11.0, forwards=98, decode_tokens=100, drafted=4, accepted=2,
                       reason=f"{PAUSED}; the best draft length was 0.80× plain expected")
    text = compare(CharTokenizer(), PLAIN, speculative, load_per_core=2.5).verdict.text.lower()
    assert PAUSED in text and "busy (load 2.5 per core)" in text
    quiet = compare(CharTokenizer(), PLAIN, speculative, load_per_core=0.3).verdict.text
    assert "busy" not in quiet


def test_a_drafters_cost_is_named_when_measured():
    speculative = side("speculative", decode_s=5.0, forwards=40, decode_tokens=100, drafted=80, accepted=60)
    text = compare(CharTokenizer(), PLAIN, speculative, draft_cost=0.21).verdict.text.lower()
    assert "faster than plain" in text and "drafting one token cost 0.21 of a plain step" in text


def test_differing_answers_are_explained_by_the_sampling_used():
    speculative = side("speculative", decode_s=5.0, forwards=40, decode_tokens=100, drafted=80, accepted=60,
                       ids=(1, 2, 4))
    sampled = compare(CharTokenizer(), PLAIN, speculative, temperature=0.7).verdict.text
    assert "temperature 0.7" in sampled and "bug" not in sampled
    greedy = compare(CharTokenizer(), PLAIN, speculative, temperature=0.0).verdict.text
    assert "bug" in greedy and "temperature" not in greedy.replace("although decoding was greedy", "")


def test_a_stopped_ab_says_so():
    unfinished = Side("speculative", stats=Stats(mode="speculative", finish_reason="stopped"))
    result = compare(CharTokenizer(), PLAIN, unfinished)
    assert result.stopped and result.verdict.text.startswith("Stopped")
