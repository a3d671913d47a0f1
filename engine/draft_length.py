"""How many tokens to draft each round: fixed, the +2/-1 rule, or chosen from measured cost.

Cost mode (the default: `DecodeSettings.draft_tokens=None`). A round that drafts k tokens
costs k draft steps plus one target pass over k+1 tokens, and yields in expectation

    E[tokens](k) = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)

tokens (the bonus token counts), where a is the chance that a draft token is accepted given
that the ones before it were. k is the one of 0..max_draft_tokens that maximises

    rate(k) = E[tokens](k) / (k * c + t(k+1) + o)

with c the drafter's step cost, t(n) the target's cost over n tokens and o the loop's own
per-round cost (sampling, detokenizing, statistics). k = 0 is a plain step (rate 1 / (t(1) + o)):
chosen when no draft pays for itself, so a weak drafter costs at most the occasional probe
(one token drafted every PROBE_EVERY plain rounds, so acceptance is still measured).

Worked example (a Qwen2.5-VL-3B-shaped target in bfloat16 on a 2-core CPU, measured: t(n)/t(1)
= 1.07, 1.18, 1.39, 1.76 for n = 2, 3, 5, 9, so t(4) = 1.285 interpolated; a 0.5B drafter's
step c = 0.21 t(1); o = 0), in units of t(1), at a = 0.7: rate(0) = 1.00, rate(1) = 1.70 / 1.28
= 1.33, rate(2) = 2.19 / 1.60 = 1.37, rate(3) = 2.53 / 1.915 = 1.32, rate(4) = 2.77 / 2.23 = 1.24:
k = 2. At a = 0.9, k = 5 (1.85x); at a = 0.1 every draft loses (k = 1: 0.86x): k = 0.
tests/test_draft_length.py asserts this example.

Where the numbers come from, all measured while answering (no calibration pass):
- t(n), c and o: `PassCosts`, held by the Engine and shared by its requests; running medians
  of the last WINDOW samples of each. A t(n) not measured yet is interpolated between measured
  neighbours, or scaled from the nearest one by PRIOR_SLOPE (t(n) ~ t(1) * (1 + 0.1 (n-1)),
  the bfloat16 figure at 3B); choosing such a k measures it.
- a: this request's own rounds (accepted tokens / tokens that met a verdict: the accepted ones
  and the first rejected one of each round), with older rounds decaying by DECAY each round,
  and PRIOR_WEIGHT pseudo-tokens at the drafter's acceptance over earlier requests (itself pulled
  towards 0.5 by HISTORY_PRIOR pseudo-tokens: 0.5 for a drafter never seen).

Stopping on thin evidence: after one rejected round the estimate rests on a few tokens, and a
drafter stopped on so little is only probed again PROBE_EVERY rounds later, after a short answer
has ended. So while fewer than THIN_EVIDENCE of the request's drafted tokens have been judged,
k is chosen at an optimistic a, OPTIMISM standard errors higher (sqrt(a (1 - a) / (n + 1)) over
those n tokens and the pseudo-tokens), and where k = 0 wins at the estimate but not at that
optimistic a, the round drafts one token to learn more. After that the estimate alone decides,
so a drafter that keeps failing is stopped within a few rounds.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

WINDOW = 15
PRIOR_SLOPE = 0.1
PRIOR_WEIGHT = 2.0
DECAY = 0.95
PROBE_EVERY = 16
FIRST_K = 4  # before anything is measured
THIN_EVIDENCE = 16
OPTIMISM = 1.0  # standard errors added to the acceptance estimate before choosing k


HISTORY_PRIOR = 8  # pseudo-tokens at acceptance 0.5 in a drafter's history


class PassCosts:
    """Costs measured on one engine: t(n) per token count, each drafter's step cost, the loop's
    per-round overhead, and each drafter's acceptance over past requests."""

    def __init__(self):
        self.verify: dict[int, deque] = {}  # n -> recent seconds of a target pass over n tokens
        self.step: dict[str, deque] = {}  # drafter name -> recent seconds per drafted token
        self.overhead: deque = deque(maxlen=WINDOW)  # seconds a round spends outside draft and verify
        self.history: dict[str, list[float]] = {}  # drafter name -> [accepted, judged] over past requests

    def record_round(self, drafter: str | None, num_drafted: int, draft_s: float, verify_s: float,
                     round_s: float) -> None:
        self.verify.setdefault(num_drafted + 1, deque(maxlen=WINDOW)).append(verify_s)
        if drafter is not None and num_drafted > 0:
            self.step.setdefault(drafter, deque(maxlen=WINDOW)).append(draft_s / num_drafted)
        self.overhead.append(max(0.0, round_s - draft_s - verify_s))

    def t(self, n: int) -> float | None:
        """Seconds of a target pass over n tokens (measured, interpolated or scaled)."""
        if n in self.verify:
            return statistics.median(self.verify[n])
        below = max((m for m in self.verify if m < n), default=None)
        above = min((m for m in self.verify if m > n), default=None)
        if below is not None and above is not None:
            t_below, t_above = self.t(below), self.t(above)
            return t_below + (t_above - t_below) * (n - below) / (above - below)
        nearest = below if below is not None else above
        if nearest is None:
            return None
        return self.t(nearest) * _prior(n) / _prior(nearest)

    def step_s(self, drafter: str) -> float | None:
        return statistics.median(self.step[drafter]) if self.step.get(drafter) else None

    def overhead_s(self) -> float:
        return statistics.median(self.overhead) if self.overhead else 0.0

    def prior_acceptance(self, drafter: str) -> float:
        """The drafter's acceptance over earlier requests, pulled towards 0.5 by HISTORY_PRIOR
        pseudo-tokens, so that a few early tokens (a warm-up's, say) cannot fix it at 0 and keep
        a short answer from ever drafting."""
        accepted, judged = self.history.get(drafter, (0.0, 0.0))
        return (accepted + 0.5 * HISTORY_PRIOR) / (judged + HISTORY_PRIOR)

    def reset(self) -> None:
        """Forget everything measured (after a warm-up: cold-start timings and a made-up prompt's
        acceptance say nothing about the requests to come)."""
        self.__init__()

    def record_request(self, drafter: str, accepted: float, judged: float) -> None:
        total = self.history.setdefault(drafter, [0.0, 0.0])
        total[0] += accepted
        total[1] += judged


def _prior(n: int) -> float:
    return 1 + PRIOR_SLOPE * (n - 1)


def expected_tokens(a: float, k: int) -> float:
    """Tokens a round that drafts k yields, bonus token included, at per-token acceptance a."""
    return k + 1.0 if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)


@dataclass
class Choice:
    k: int
    reason: str


def best_k(costs: PassCosts, drafter: str, a: float, max_k: int) -> Choice:
    """The k of 0..max_k with the most expected tokens per second, and why."""
    t1, c, o = costs.t(1), costs.step_s(drafter), costs.overhead_s()
    if t1 is None or c is None:
        return Choice(FIRST_K, f"cost: nothing measured yet, starting at k = {FIRST_K}")
    rates = {k: expected_tokens(a, k) / (k * c + costs.t(k + 1) + o) for k in range(max_k + 1)}
    k = max(rates, key=rates.get)
    facts = f"acceptance {a:.2f}, draft step {c / t1:.2f} t(1)"
    if k == 0:
        return Choice(0, f"cost: drafting is a loss ({facts}; best draft k = "
                         f"{max(range(1, max_k + 1), key=rates.get, default=1)} at "
                         f"{max([rates[j] for j in range(1, max_k + 1)], default=0) / rates[0]:.2f}x plain): plain "
                         f"steps, one-token probe every {PROBE_EVERY}")
    return Choice(k, f"cost: k = {k}, {rates[k] / rates[0]:.2f}x plain expected ({facts}, "
                     f"t({k + 1}) = {costs.t(k + 1) / t1:.2f} t(1))")


class DraftLength:
    """One request's draft length: `k` now; `update(...)` after each round, with its timings."""

    def __init__(self, draft_tokens: int | None, adaptive: bool, max_draft_tokens: int,
                 costs: PassCosts | None, drafter: str | None):
        self.fixed, self.adaptive, self.max_k = draft_tokens, adaptive, max_draft_tokens
        self.costs = costs if costs is not None else PassCosts()
        self.drafter = drafter
        self.accepted = self.judged = 0.0  # this request's rounds, decayed
        self.request_accepted = self.request_judged = 0  # not decayed, for the engine's history
        self.plain_rounds = 0
        if adaptive or draft_tokens is not None:
            self.k = draft_tokens or FIRST_K
            self.reason = (f"adaptive: from {self.k}, +2 after a full acceptance, -1 after a rejection" if adaptive
                           else f"fixed: draft_tokens {self.k}")
        else:
            self._choose()

    @property
    def acceptance(self) -> float:
        prior = self.costs.prior_acceptance(self.drafter) if self.drafter else 0.5
        return (self.accepted + PRIOR_WEIGHT * prior) / (self.judged + PRIOR_WEIGHT)

    @property
    def optimistic_acceptance(self) -> float:
        """The estimate plus OPTIMISM standard errors (see "stopping on thin evidence" above)."""
        a, n = self.acceptance, self.request_judged + PRIOR_WEIGHT  # evidence is not decayed
        return min(1.0, a + OPTIMISM * math.sqrt(a * (1 - a) / (n + 1)))

    def update(self, num_drafted: int, num_accepted: int, draft_s: float, verify_s: float, round_s: float) -> int:
        """Learn one round (tokens drafted / accepted, seconds drafting / verifying / in all); the next k."""
        self.costs.record_round(self.drafter, num_drafted, draft_s, verify_s, round_s)
        if num_drafted:
            judged = num_accepted + (num_accepted < num_drafted)
            self.accepted = self.accepted * DECAY + num_accepted
            self.judged = self.judged * DECAY + judged
            self.request_accepted += num_accepted
            self.request_judged += judged
        if self.drafter is None:
            return self.k
        if self.adaptive and num_drafted:
            self.k = min(self.k + 2, self.max_k) if num_accepted == num_drafted else max(self.k - 1, 1)
        elif self.fixed is None:
            self._choose()
        return self.k

    def finish(self) -> None:
        """Add this request's acceptance to the drafter's history on the engine."""
        if self.drafter and self.request_judged:
            self.costs.record_request(self.drafter, self.request_accepted, self.request_judged)

    def _choose(self) -> None:
        if self.drafter is None:
            self.k, self.reason = 0, "plain decoding"
            return
        choice = best_k(self.costs, self.drafter, self.acceptance, self.max_k)
        if self.request_judged < THIN_EVIDENCE:  # little seen yet: choose at the optimistic acceptance
            hopeful = best_k(self.costs, self.drafter, self.optimistic_acceptance, self.max_k)
            if choice.k > 0:
                choice = hopeful
            elif hopeful.k > 0:
                choice = Choice(1, f"cost: drafting looks like a loss on {self.request_judged} tokens judged "
                                   f"(acceptance {self.acceptance:.2f}): one token to measure more")
        self.plain_rounds = self.plain_rounds + 1 if choice.k == 0 else 0
        if choice.k == 0 and self.plain_rounds % PROBE_EVERY == 0:
            choice = Choice(1, f"cost: probe (one token after {PROBE_EVERY} plain steps) to re-measure acceptance")
        self.k, self.reason = choice.k, choice.reason
