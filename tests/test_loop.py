"""The decode loop on mock models whose logits the test chooses."""

from __future__ import annotations

import threading
import pytest
import torch
from scipy.stats import chi2

from engine.loop import DecodeSettings, Done, generate
from engine.sampling import SamplingSettings
from tests.mocks import (CharTokenizer, FaultyDrafter, MarkovDrafter, MarkovRunner, ScriptedDrafter, expected_accepts,
                         prompt_of)

V = 8
GREEDY = SamplingSettings()
pytestmark = pytest.mark.usefixtures("one_thread")  # thousands of tiny answers: threads only contend


def table(seed, sharpness=3.0):
    return torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * sharpness


def answer(target_table, drafter=None, sampling=GREEDY, stop=None, **decode):
    decode = DecodeSettings(**{"max_new_tokens": 30, "draft_tokens": 4, **decode})
    events = list(generate(MarkovRunner(target_table), CharTokenizer(), prompt_of([1, 2, 3]), drafter,
                           sampling, decode, stop))
    assert isinstance(events[-1], Done)
    return events


def plain_ids(target_table, **decode):
    return answer(target_table, **decode)[-1].token_ids


def test_perfect_drafter_is_fully_accepted():
    t = table(0)
    truth = plain_ids(t)
    done = answer(t, ScriptedDrafter(truth))[-1]
    assert done.token_ids == truth
    assert done.stats.acceptance == 1.0
    # 1 token from prefill, then rounds of 4 accepted + 1 bonus: 29 = 5 * 5 + 4
    assert done.stats.target_forwards == 6
    assert done.stats.tokens_per_forward == pytest.approx(29 / 6)
    assert done.stats.accepted_by_position == done.stats.drafted_by_position


def test_corrupted_drafts_are_accepted_exactly_up_to_the_corruption():
    t = table(1)
    truth = plain_ids(t)
    corrupted = list(truth)
    for i in range(3, len(corrupted), 7):
        corrupted[i] = (corrupted[i] + 1) % V
    drafter = ScriptedDrafter(corrupted)
    events = answer(t, drafter)
    assert events[-1].token_ids == truth
    expected = expected_accepts(truth, corrupted, events[-1].stats.draft_lengths)
    assert drafter.accepted[:len(expected)] == expected
    origins = [o for e in events[:-1] for o in e.origins]
    assert origins.count("draft") == events[-1].stats.accepted


def test_empty_drafts_decode_plainly():
    t = table(2)
    done = answer(t, ScriptedDrafter([]))[-1]
    assert done.token_ids == plain_ids(t)
    assert done.stats.drafted == 0 and done.stats.acceptance is None
    assert done.stats.tokens_per_forward == 1.0


@pytest.mark.parametrize("fail", [{"fail_at_begin": True}, {"fail_at_round": 3}])
def test_failing_drafter_falls_back_to_plain_and_completes(fail):
    t = table(3)
    truth = plain_ids(t)
    done = answer(t, ScriptedDrafter(truth, **fail))[-1]
    assert done.token_ids == truth
    assert "drafter" in done.stats.fallback_reason and "exploded" in done.stats.fallback_reason


@pytest.mark.parametrize("method,call,draft_tree", [
    ("begin", 1, 0), ("propose", 3, 0), ("accept", 3, 0),
    ("tree_unsupported", 1, 4), ("propose_tree", 3, 4), ("accept", 3, 4)])
def test_a_drafter_call_that_raises_hands_the_request_to_plain_decoding(method, call, draft_tree):
    """Any drafter call that raises ends drafting for the request, with the call named in the
    reason; the answer is plain greedy's, the target stops computing what the drafter read, and
    the drafter is never called again."""
    t = table(18)  # a 6-token cycle
    truth = plain_ids(t)
    drafter, target = FaultyDrafter(t, method, call), MarkovRunner(t)
    events = list(generate(target, CharTokenizer(), prompt_of([1, 2, 3]), drafter, GREEDY,
                           DecodeSettings(max_new_tokens=30, draft_tokens=4, draft_tree=draft_tree)))
    done = events[-1]
    assert done.token_ids == truth
    assert done.stats.fallback_reason.startswith(f"drafter failed in {method} "), done.stats.fallback_reason
    assert done.stats.fallback_reason.endswith(f"RuntimeError: {method} exploded")
    assert drafter.faulted and drafter.calls_after_fault == 0 and not target.state.reading
    assert (done.stats.drafted == 0) == (call == 1)  # drafts before the fault only


def test_stop_token_inside_an_accepted_draft_ends_the_answer():
    t = table(4)
    truth = plain_ids(t)
    stop_token = truth[6]
    done = answer(t, ScriptedDrafter(truth), stop_token_ids=frozenset({stop_token}))[-1]
    assert done.token_ids == truth[: truth.index(stop_token) + 1]
    assert done.stats.finish_reason == "stop_token"


@pytest.mark.parametrize("stop_at", [1, 2, 3, 6])
def test_drafts_after_the_stop_token_are_not_counted(stop_at):
    """A perfect drafter whose draft runs past the stop token: the statistics count only the
    draft tokens that made it into the answer, so accepted <= decode tokens, always."""
    t = table(4)
    truth = plain_ids(t)
    stop_token = truth[stop_at]
    done = answer(t, ScriptedDrafter(truth), stop_token_ids=frozenset({stop_token}))[-1]
    stats = done.stats
    assert done.token_ids == truth[: truth.index(stop_token) + 1]
    assert stats.accepted <= stats.decode_tokens == len(done.token_ids) - 1
    assert stats.acceptance == 1.0  # every draft token that counted was right
    assert sum(stats.accepted_by_position) == stats.accepted <= stats.drafted == sum(stats.drafted_by_position)
    assert stats.tokens_per_forward == stats.decode_tokens / stats.target_forwards


@pytest.mark.parametrize("max_new", [1, 2, 7])
def test_max_new_tokens_is_exact(max_new):
    t = table(5)
    done = answer(t, ScriptedDrafter(plain_ids(t)), max_new_tokens=max_new)[-1]
    assert len(done.token_ids) == max_new
    assert done.stats.finish_reason == "max_new_tokens"


def test_stop_flag_ends_promptly():
    stop = threading.Event()
    gen = generate(MarkovRunner(table(6)), CharTokenizer(), prompt_of([1]), None, GREEDY,
                   DecodeSettings(max_new_tokens=1000), stop)
    next(gen), next(gen)
    stop.set()
    rest = list(gen)
    assert isinstance(rest[-1], Done) and rest[-1].stats.finish_reason == "stopped"
    assert len(rest[-1].token_ids) <= 3


def test_adaptive_draft_length_grows_on_acceptance_and_shrinks_on_rejection():
    t = table(7)
    truth = plain_ids(t, max_new_tokens=60)
    lengths = answer(t, ScriptedDrafter(truth), max_new_tokens=60, adaptive=True)[-1].stats.draft_lengths
    assert lengths[:3] == [4, 6, 8]
    wrong = [(x + 1) % V for x in truth]
    lengths = answer(t, ScriptedDrafter(wrong), max_new_tokens=60, adaptive=True)[-1].stats.draft_lengths
    assert lengths[:4] == [4, 3, 2, 1]


@pytest.mark.parametrize("draft_tree", [0, 4])
def test_rejection_sampling_keeps_the_targets_distribution(draft_tree):
    """Tokens 2 and 3 of sampled answers (the first comes from prefill) follow the target's
    distribution although the drafter's differs, with chains (sampled from the drafter) and
    with trees (the drafter's 2 likeliest tokens, each with its greedy child: multi-draft
    rejection sampling). 5000 answers, fixed seeds, Pearson's chi-square test against the exact
    target probabilities at p > 0.001; the same samples tested against the drafter's
    probabilities must fail (the test has power)."""
    target, draft = table(8, 1.0), table(9, 1.0)
    observed = torch.zeros(V, V, V)  # counts of (token1, token2, token3)
    for seed in range(5000):
        done = answer(target, MarkovDrafter(draft), SamplingSettings(temperature=1.0, seed=seed),
                      max_new_tokens=3, draft_tokens=2, draft_tree=draft_tree)[-1]
        assert done.stats.draft_shape == ("tree" if draft_tree else "chain")
        observed[tuple(done.token_ids)] += 1

    def p_value(logits_table):
        probs = logits_table.softmax(-1)
        expected = observed.sum((1, 2))[:, None, None] * probs[:, :, None] * probs[None, :, :]
        cells = expected > 0
        statistic = float(((observed - expected) ** 2 / expected)[cells].sum())
        return chi2.sf(statistic, int(cells.sum()) - V)

    assert p_value(target) > 0.001
    assert p_value(draft) < 1e-6


class OrderRecordingDrafter(ScriptedDrafter):
    """Records how many answer chunks the consumer had received when `begin` ran."""

    def __init__(self, continuation, received):
        super().__init__(continuation)
        self.received, self.begun_after = received, None

    def begin(self, prompt, target_state):
        self.begun_after = len(self.received)
        return self


def test_first_token_is_yielded_before_the_drafter_prefills():
    t = table(10)
    truth = plain_ids(t)
    received = []
    drafter = OrderRecordingDrafter(truth, received)
    stream = generate(MarkovRunner(t), CharTokenizer(), prompt_of([1, 2, 3]), drafter, GREEDY,
                      DecodeSettings(max_new_tokens=30, draft_tokens=4))
    received.append(next(stream))
    assert received[0].token_ids == truth[:1] and drafter.begun_after is None  # not prefilled yet
    received += list(stream)
    assert drafter.begun_after == 1  # prefilled after the consumer had the first token
    assert received[-1].token_ids == truth and received[-1].stats.drafted > 0


def test_a_one_token_answer_never_prefills_the_drafter():
    t = table(11)
    drafter = OrderRecordingDrafter(plain_ids(t), [])
    done = answer(t, drafter, max_new_tokens=1)[-1]
    assert drafter.begun_after is None and len(done.token_ids) == 1
    assert done.stats.mode == "speculative" and done.stats.drafted == 0


@pytest.mark.parametrize("temperature", (1e-300, 1e-45))
def test_a_temperature_too_small_for_float32_samples_the_likeliest_tokens(temperature):
    """logits / temperature overflow to inf (softmax would give NaN): the distribution is its limit,
    the likeliest tokens alone, alike; a normal temperature keeps its own bits."""
    from engine.sampling import Sampler, SamplingSettings

    logits = torch.tensor([1.0, 3.0, -2.0, 3.0, float("-inf")])
    probs = Sampler(SamplingSettings(temperature=temperature, seed=0)).probs(logits)
    assert torch.equal(probs, torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0]))
    assert torch.equal(Sampler(SamplingSettings(temperature=0.7, seed=0)).probs(logits), (logits / 0.7).softmax(-1))
