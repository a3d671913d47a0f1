"""Draft length from cost (engine/draft_length.py): the worked example, and the loop on mock
models whose costs the test chooses, timed by a virtual clock (behaviour asserted, never the
machine's timings)."""

from __future__ import annotations

import sys
from collections import deque

import pytest
import torch

import engine.loop
from engine.draft_length import PROBE_EVERY, PassCosts, best_k, expected_tokens
from engine.loop import DecodeSettings, generate
from engine.sampling import SamplingSettings
from measure.replay import ReplayDrafter
from tests.mocks import CharTokenizer, MarkovRunner, prompt_of

V = 16
T1, SLOPE, STEP = 1.0, 0.09, 0.21  # t(n) = T1 (1 + SLOPE (n-1)); a draft step costs STEP (the 3B shape's)


def measured(verify: dict[int, float], step: float) -> PassCosts:
    costs = PassCosts()
    costs.verify = {n: deque([t]) for n, t in verify.items()}
    costs.step["d"] = deque([step])
    return costs


def test_worked_example_of_the_docstring():
    costs = measured({1: 1.0, 2: 1.07, 3: 1.18, 5: 1.39, 9: 1.76}, 0.21)
    assert costs.t(4) == pytest.approx(1.285)
    assert best_k(costs, "d", 0.7, 8).k == 2
    assert best_k(costs, "d", 0.9, 8).k == 5
    choice = best_k(costs, "d", 0.1, 8)
    assert choice.k == 0 and "loss" in choice.reason
    assert expected_tokens(0.7, 2) == pytest.approx(1 + 0.7 + 0.49)
    assert expected_tokens(1.0, 4) == 5


def test_unmeasured_costs_are_scaled_from_the_nearest_measurement():
    costs = measured({5: 1.4}, 0.1)
    assert costs.t(1) == pytest.approx(1.4 / 1.4)  # prior 1 + 0.1 (n-1)
    assert costs.t(9) == pytest.approx(1.4 * 1.8 / 1.4)
    assert PassCosts().t(3) is None
    assert best_k(PassCosts(), "d", 0.9, 8).reason.startswith("cost: nothing measured")


def test_a_flat_cost_curve_and_a_free_drafter_draft_long():
    assert best_k(measured({n: 1.0 for n in range(1, 10)}, 0.0), "d", 0.8, 8).k == 8


class VirtualClock:
    """Seconds advance only when a mock model runs: the test chooses every cost."""

    def __init__(self):
        self.seconds = 0.0

    def now(self) -> float:
        return self.seconds


class TimedRunner(MarkovRunner):
    def __init__(self, table, clock):
        super().__init__(table)
        self.clock = clock

    def extend(self, state, token_ids):
        self.clock.seconds += T1 * (1 + SLOPE * (len(token_ids) - 1))
        return super().extend(state, token_ids)


class TimedReplay(ReplayDrafter):
    def __init__(self, answer, acceptance, clock, seed=3):
        super().__init__(answer, acceptance, V, seed=seed)
        self.clock = clock

        self.rounds: list[tuple[int, int]] = []  # (drafted, accepted) per round

    def propose(self, generated, k, sampler):
        self.clock.seconds += STEP * k
        draft = super().propose(generated, k, sampler)
        self.rounds.append((len(draft.token_ids), 0))
        return draft

    def accept(self, num_accepted):
        self.rounds[-1] = (self.rounds[-1][0], num_accepted)


def repetitive_table() -> torch.Tensor:
    """The greedy answer cycles through 0..V-1 (a long repetitive answer)."""
    table = torch.full((V, V), -5.0)
    table[torch.arange(V), (torch.arange(V) + 1) % V] = 5.0
    return table


def timed_answer(monkeypatch, acceptance: float | None, length: int = 300, wrong_at=(), seed=3, **decode):
    """One answer of `length` tokens on the virtual clock; the drafter's proposals are corrupted
    at its replay rate and also at the answer positions `wrong_at`."""
    clock = VirtualClock()
    monkeypatch.setattr(engine.loop, "Clock", lambda device: clock)
    runner = TimedRunner(repetitive_table(), clock)
    truth = [(3 + 1 + i) % V for i in range(length)]
    drafter = None if acceptance is None else TimedReplay(truth, acceptance, clock, seed)
    for position in wrong_at:
        drafter.proposals[position] = (truth[position] + 1) % V
    events = list(generate(runner, CharTokenizer(), prompt_of([1, 2, 3]), drafter, SamplingSettings(),
                           DecodeSettings(max_new_tokens=length, **decode)))
    done = events[-1]
    assert done.token_ids == truth
    timed_answer.drafter = drafter
    return done.stats, clock.seconds


def test_a_weak_drafter_stops_drafting_and_costs_at_most_a_few_percent(monkeypatch):
    _, plain_s = timed_answer(monkeypatch, None)
    stats, cost_s = timed_answer(monkeypatch, 0.1)
    _, fixed_s = timed_answer(monkeypatch, 0.1, draft_tokens=4)
    assert fixed_s > 1.3 * plain_s  # a fixed k = 4 with this drafter is a clear loss...
    assert cost_s < 1.05 * plain_s  # ...that the cost-chosen k avoids
    assert stats.draft_lengths.count(0) > 0.8 * len(stats.draft_lengths)  # plain steps, mostly
    stop = next(c for c in stats.draft_length_changes if c["k"] == 0)
    assert stop["token"] < 20 and "drafting is a loss" in stop["reason"]  # when and why
    # after a few one-token rounds while the evidence is thin, a probe every PROBE_EVERY rounds
    probes = [i for i, k in enumerate(stats.draft_lengths) if k == 1 and i > 2 * PROBE_EVERY]
    assert len(probes) >= 5 and all(b - a >= PROBE_EVERY - 1 for a, b in zip(probes, probes[1:]))


@pytest.mark.parametrize("acceptance", [0.9, 0.8, 0.6])
def test_the_cost_chosen_length_is_within_5_percent_of_the_best_fixed_one(monkeypatch, acceptance):
    """Averaged over four replay seeds: which positions a drafter gets wrong decides which k
    happens to fit one answer, by a few per cent either way."""
    _, plain_s = timed_answer(monkeypatch, None)
    ratios, fixed_4 = [], []
    for seed in range(4):
        stats, cost_s = timed_answer(monkeypatch, acceptance, seed=seed)
        fixed_s = {k: timed_answer(monkeypatch, acceptance, seed=seed, draft_tokens=k)[1] for k in range(1, 7)}
        assert cost_s < plain_s and stats.draft_length_reason.startswith("cost: k =")
        ratios.append(cost_s / min(fixed_s.values()))
        fixed_4.append(cost_s / fixed_s[4])
    assert sum(ratios) / len(ratios) <= 1.05 and max(ratios) <= 1.10
    if acceptance == 0.6:
        assert sum(fixed_4) / len(fixed_4) < 0.92  # where the habitual k = 4 drafts too long


def test_one_bad_round_does_not_stop_a_good_drafter_on_a_short_answer(monkeypatch):
    """A drafter wrong on the answer's first two tokens and right on the rest (a text drafter
    guessing what an image shows, then the sentence around it), its step 0.4 t(1) as the bundled
    model's drafters: on a 24-token answer the cost rule must keep drafting after the early
    rejections, not decode the rest plainly (it did: 3 of 24 tokens accepted, as slow as plain)."""
    monkeypatch.setattr(sys.modules[__name__], "STEP", 0.4)
    _, plain_s = timed_answer(monkeypatch, None, length=24)
    stats, cost_s = timed_answer(monkeypatch, 1.0, length=24, wrong_at=(0, 1))
    _, fixed_s = timed_answer(monkeypatch, 1.0, length=24, wrong_at=(0, 1), draft_tokens=4)
    assert stats.accepted >= 14
    assert cost_s < 0.8 * plain_s and cost_s < 1.1 * fixed_s


def test_fixed_and_adaptive_lengths_are_kept(monkeypatch):
    stats, _ = timed_answer(monkeypatch, 0.1, draft_tokens=3)
    assert {c["k"] for c in stats.draft_length_changes} == {3}
    assert stats.draft_length_reason == "fixed: draft_tokens 3"
    stats, _ = timed_answer(monkeypatch, 1.0, adaptive=True)
    assert stats.draft_lengths[:3] == [4, 6, 8] and stats.draft_length_reason.startswith("adaptive")


@pytest.mark.parametrize("acceptance", [1.0, 0.8, 0.6])
def test_replay_drafter_is_accepted_at_its_rate(monkeypatch, acceptance):
    """Per-token acceptance (accepted / tokens judged: the accepted and each round's first
    rejected one) is the rate the replay drafter was set to, within sampling noise."""
    stats, _ = timed_answer(monkeypatch, acceptance, draft_tokens=4)
    rounds = timed_answer.drafter.rounds
    assert sum(a for _, a in rounds) == stats.accepted
    rejections = sum(a < d for d, a in rounds)
    assert stats.accepted / (stats.accepted + rejections) == pytest.approx(acceptance, abs=0.06)
    drafter = ReplayDrafter(list(range(1000)), acceptance, 2000, seed=5)
    assert drafter.corrupted_positions() / 1000 == pytest.approx(1 - acceptance, abs=0.04)



def test_a_few_early_tokens_do_not_fix_a_drafters_prior_at_zero():
    """A warm-up's 4 rejected tokens must not make every later short answer decode plainly: the
    history is pulled towards 0.5, and the app's warm-up forgets everything it measured."""
    from engine.draft_length import PassCosts

    costs = PassCosts()
    costs.record_request("drafter", accepted=0, judged=4)
    assert 0.3 < costs.prior_acceptance("drafter") < 0.5
    costs.record_request("drafter", accepted=900, judged=1000)
    assert costs.prior_acceptance("drafter") > 0.85
    costs.reset()
    assert costs.prior_acceptance("drafter") == 0.5 and costs.t(1) is None
