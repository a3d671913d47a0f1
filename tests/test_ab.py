"""The A/B verdict (engine/ab.py) is derived from the measured figures and never contradicts them:
sides with chosen statistics, compared as the A/B compares them; the A/B's alternating pairs on
mock models timed by a virtual clock whose load the test chooses, and on the real tiny models."""

from __future__ import annotations

import random
import re
import threading

import pytest

import engine.loop
from engine.ab import MIN_PAIRS, Side, _ceiling, compare, run_ab
from engine.draft_length import PassCosts
from engine.loop import DecodeSettings, generate
from engine.stats import PAUSED, Stats
from tests.mocks import CharTokenizer, prompt_of


def side(mode: str, decode_s: float, forwards: int, decode_tokens: int, drafted: int = 0, accepted: int = 0,
         total_s: float | None = None, ids=(1, 2, 3), reason: str | None = None) -> Side:
    stats = Stats(mode=mode, drafter="d" if mode == "speculative" else None, decode_s=decode_s,
                  decode_tokens=decode_tokens, decode_tok_s=decode_tokens / decode_s, target_forwards=forwards,
                  tokens_per_forward=decode_tokens / forwards, drafted=drafted, accepted=accepted,
                  acceptance=accepted / drafted if drafted else None, total_s=total_s or decode_s + 0.1,
                  draft_length_reason=reason)
    return Side(mode, token_ids=list(ids), done=True, stats=stats)


PLAIN = side("plain", decode_s=10.0, forwards=100, decode_tokens=100, total_s=10.5)


def twice(speculative: Side, plain: Side = PLAIN) -> list:
    """Two pairs timed alike: no spread, so the speedup is a result."""
    return [(plain.stats, speculative.stats)] * 2


def test_issue_25_slower_decode_faster_answer_at_temperature_0():
    """The A/B that said "too few to pay for drafting (sampling at temperature > 0 ...; the small
    VLM drafter is accepted most often)" at temperature 0 with the VLM drafter, beside "whole
    answer 1.17x as fast": the verdict now rests on the figures, and names the whole answer's."""
    speculative = side("speculative", decode_s=12.0, forwards=60, decode_tokens=100, drafted=50, accepted=40,
                       total_s=9.0)
    result = compare(CharTokenizer(), PLAIN, speculative, temperature=0.0, pairs=twice(speculative))
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
        result = compare(CharTokenizer(), PLAIN, speculative, pairs=twice(speculative))
        verdict, speedup = result.verdict, result.decode_speedup
        assert verdict.round_cost and speculative.stats.tokens_per_forward / verdict.round_cost == pytest.approx(speedup)
        tokens, rounds, quoted = map(float, re.search(r"([\d.]+) / ([\d.]+) = ([\d.]+)×", verdict.text).groups())
        assert quoted == float(f"{speedup:.2f}")
        accepted = speculative.stats.accepted > 0
        assert ("faster than" in verdict.headline) == (speedup > 1 and accepted)
        assert ("slower than" in verdict.headline) == (speedup < 1)


def test_paused_drafting_and_a_busy_machine_are_named():
    speculative = side("speculative", decode_s=11.0, forwards=98, decode_tokens=100, drafted=4, accepted=2,
                       reason=f"{PAUSED}; the best draft length was 0.80× plain expected")
    text = compare(CharTokenizer(), PLAIN, speculative, load_per_core=2.5).verdict.text.lower()
    assert PAUSED in text and "busy (load 2.5 per core)" in text
    quiet = compare(CharTokenizer(), PLAIN, speculative, load_per_core=0.3).verdict.text
    assert "busy" not in quiet


def test_a_drafters_cost_is_named_when_measured():
    speculative = side("speculative", decode_s=5.0, forwards=40, decode_tokens=100, drafted=80, accepted=60)
    text = compare(CharTokenizer(), PLAIN, speculative, draft_cost=0.21, pairs=twice(speculative)).verdict.text.lower()
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


def test_no_accepted_token_is_never_faster():
    """The haiku at temperature 0.9: "Speedup 1.26x ... faster" beside "acceptance 0 %: 0 of 2 drafted
    tokens kept". Every pair faster still says no measurable difference when nothing was accepted."""
    nothing_kept = side("speculative", decode_s=8.0, forwards=100, decode_tokens=100, drafted=2, accepted=0,
                        reason=f"{PAUSED}; the best draft length was 0.80× plain expected")
    result = compare(CharTokenizer(), PLAIN, nothing_kept, temperature=0.9, pairs=twice(nothing_kept))
    assert result.decode_speedup == pytest.approx(1.25) and not result.measured
    assert result.verdict.headline.startswith("No measurable difference: no drafted token was accepted")
    assert "faster than" not in result.verdict.text
    slower = side("speculative", decode_s=12.0, forwards=100, decode_tokens=100, drafted=2, accepted=0)
    assert "slower than plain" in compare(CharTokenizer(), PLAIN, slower, pairs=twice(slower)).verdict.headline


def test_a_spread_that_includes_1_is_no_measurable_difference():
    fast = side("speculative", decode_s=5.0, forwards=40, decode_tokens=100, drafted=80, accepted=60)
    slow = side("speculative", decode_s=11.0, forwards=40, decode_tokens=100, drafted=80, accepted=60)
    result = compare(CharTokenizer(), PLAIN, fast, pairs=[(PLAIN.stats, fast.stats), (PLAIN.stats, slow.stats)])
    assert result.spread == (pytest.approx(100 / 110), 2.0) and not result.measured
    assert result.verdict.headline.startswith("No measurable difference between speculative and plain decoding")
    alone = compare(CharTokenizer(), PLAIN, fast)  # one pair: no spread to judge by
    assert not alone.measured and "1 pair timed" in alone.verdict.headline


def test_a_speedup_above_what_the_measured_costs_allow_is_flagged():
    """The chart example's "5.10x", above what a drafter that is always right and free can give:
    with t(n) / t(1) = 1.07, 1.18, 1.39 for n = 2, 3, 5 and 4 tokens drafted a round, at most
    5 / 1.39 = 3.6x."""
    from tests.test_draft_length import measured

    costs = measured({1: 1.0, 2: 1.07, 3: 1.18, 5: 1.39, 9: 1.76}, 0.21)
    impossible = side("speculative", decode_s=100 / 51, forwards=25, decode_tokens=100, drafted=100, accepted=75)
    impossible.stats.draft_lengths = [4] * 25
    ceiling = _ceiling(costs, impossible.stats)
    assert ceiling == pytest.approx(5 / 1.39)
    result = compare(CharTokenizer(), PLAIN, impossible, pairs=twice(impossible), ceiling=ceiling)
    assert result.decode_speedup == pytest.approx(5.1) and result.impossible and not result.measured
    assert result.verdict.headline.startswith("Not a result: 5.10× is more than the 3.60×")
    possible = side("speculative", decode_s=5.0, forwards=25, decode_tokens=100, drafted=100, accepted=75)
    assert compare(CharTokenizer(), PLAIN, possible, pairs=twice(possible), ceiling=ceiling).measured
    assert _ceiling(PassCosts(), impossible.stats) is None  # nothing measured: nothing flagged
    noisy_costs = measured({1: 1.0, 2: 3.0}, 0.21)  # a busy moment priced a 2-row pass at 3 plain steps
    assert _ceiling(noisy_costs, Stats(draft_lengths=[1, 0, 1])) == 1.0  # never under what plain steps give
    one_pair = compare(CharTokenizer(), PLAIN, impossible, ceiling=ceiling)  # no spread: not a result either way
    assert not one_pair.impossible and one_pair.verdict.headline.startswith("No measurable difference")


class ClockedBackend:
    """The decode loop on mock models timed by the test's virtual clock (tests/test_draft_length.py):
    each run, in the order the A/B asks for them, at the next of `loads` (a machine that got busier)."""

    def __init__(self, monkeypatch, loads: list[float], acceptance: float = 0.7, length: int = 60):
        from engine.backend import Capabilities
        from tests.test_draft_length import V, TimedReplay, TimedRunner, VirtualClock, repetitive_table

        self.clock, self.loads, self.runs = VirtualClock(), list(loads), []
        monkeypatch.setattr(engine.loop, "Clock", lambda device: self.clock)
        self.runner = TimedRunner(repetitive_table(), self.clock)
        self.truth = [(3 + 1 + i) % V for i in range(length)]
        self.drafter = lambda: TimedReplay(self.truth, acceptance, self.clock)
        self.capabilities = Capabilities("clocked", speculative=True, drafters=("replay",), default_drafter="replay")

    def stream(self, request):
        self.clock.load = self.loads.pop(0)
        self.runs.append((request.drafter, self.clock.load, request.sampling.seed))
        return generate(self.runner, CharTokenizer(), prompt_of([1, 2, 3]), request.drafter and self.drafter(),
                        request.sampling, request.decode, request.stop)


def test_the_sides_alternate_and_a_noisy_pair_says_no_measurable_difference(monkeypatch):
    """Alternating pairs (plain, speculative, then speculative, plain): load chosen by the test on
    the virtual clock. Quiet: the drafter's real speedup is a result. A burst of load on the second
    pair's speculative answer: the spread includes 1, so no measurable difference. The answers shown
    are the first pair's, and exactly what each mode gives alone."""
    decode = DecodeSettings(max_new_tokens=60, draft_tokens=2)
    quiet = ClockedBackend(monkeypatch, [1.0] * 4)
    *progress, result = run_ab(quiet, [], "replay", decode=decode)
    assert [(drafter, seed) for drafter, _, seed in quiet.runs] == [(None, 0), ("replay", 0), ("replay", 0), (None, 0)]
    assert {event.pair for event in progress} == {1, 2} and result.pairs == MIN_PAIRS
    assert result.measured and result.decode_speedup > 1.2 and "faster than plain" in result.verdict.headline
    assert result.plain.token_ids == result.speculative.token_ids == quiet.truth and result.identical
    noisy = ClockedBackend(monkeypatch, [1.0, 1.0, 3.0, 1.0])  # the burst: the second pair's speculative run
    result = list(run_ab(noisy, [], "replay", decode=decode))[-1]
    assert result.spread[0] < 1 < result.spread[1] and not result.measured
    assert result.verdict.headline.startswith("No measurable difference") and "faster" not in result.verdict.headline
    assert result.plain.token_ids == quiet.truth  # the first pair's answers, as without the burst


def test_a_stop_during_the_timing_repeats_keeps_the_answers_and_claims_no_speedup(monkeypatch):
    stop = threading.Event()
    backend = ClockedBackend(monkeypatch, [1.0] * 4)
    stream = backend.stream

    def stopping_after_the_first_pair(request):
        if len(backend.runs) == 2:
            stop.set()
        return stream(request)

    backend.stream = stopping_after_the_first_pair
    result = list(run_ab(backend, [], "replay", decode=DecodeSettings(max_new_tokens=60, draft_tokens=2),
                         stop=stop))[-1]
    assert not result.stopped and result.identical and result.pairs == 1 and not result.measured


def test_real_tiny_models_answer_the_ab_as_each_mode_alone(engine):
    """The repeats change no answer: each side is what its mode gives alone (greedy: identical)."""
    from engine.backend import BuiltIn

    messages = [{"role": "user", "content": [{"type": "text", "text": "Describe the sky."}]}]
    decode = DecodeSettings(max_new_tokens=16)
    *_, result = run_ab(BuiltIn(engine), messages, "text", decode=decode)
    alone = list(engine.stream(messages, decode=decode))[-1]
    assert result.plain.token_ids == result.speculative.token_ids == alone.token_ids
    assert result.pairs >= MIN_PAIRS and result.measured == (result.spread[0] > 1 or result.spread[1] < 1)
    assert ("faster than" in result.verdict.headline) == (result.measured and result.decode_speedup > 1)
