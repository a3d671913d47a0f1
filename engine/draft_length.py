"""How many tokens to draft each round: chosen from measured cost (the default), fixed, or the
+2/-1 rule. docs/draft-length.md explains the rule for users.

A round that drafts k tokens costs d(k) (drafting them) plus t(k+1) (one target pass over k+1
rows) plus o (the loop's own work: sampling, detokenizing, statistics), and yields in expectation

    E[tokens](k) = 1 + a1 + a1 a2 + ... + a1 a2 ... ak

tokens (the bonus token counts), where ai is the chance that the i-th draft token is accepted
given that the ones before it were (with one a for every position, 1 + a + ... + a^k =
(1 - a^(k+1)) / (1 - a)). The cost rule drafts the k of 0..max_draft_tokens that maximises

    rate(k) = E[tokens](k) / (d(k) + t(k+1) + o)

k = 0 is a plain step (rate 1 / (t(1) + o)): chosen when no draft pays for itself ("drafting
paused"), with one token drafted every PROBE_EVERY plain steps so that acceptance is still
measured. A fixed k is kept as asked unless its drafts are nearly all rejected (acceptance
estimate under FIXED_FLOOR after THIN_EVIDENCE tokens judged): then it is paused the same way.
That decision reads the answer's tokens only, never timings, so a seeded sampled answer at a
fixed k is reproducible.

Worked example (a Qwen2.5-VL-3B-shaped target in bfloat16 on a 2-core CPU, measured: t(n)/t(1)
= 1.07, 1.18, 1.39, 1.76 for n = 2, 3, 5, 9, so t(4) = 1.285 interpolated; a 0.5B drafter's
d(k) = 0.21 k t(1); o = 0), in units of t(1), at a = 0.7: rate(0) = 1.00, rate(1) = 1.70 / 1.28
= 1.33, rate(2) = 2.19 / 1.60 = 1.37, rate(3) = 2.53 / 1.915 = 1.32, rate(4) = 2.77 / 2.23 = 1.24:
k = 2. At a = 0.9, k = 5 (1.85x); at a = 0.1 every draft loses (k = 1: 0.86x): k = 0.
tests/test_draft_length.py asserts this example.

Costs measured close together. On a shared machine the time of everything rises and falls with
the load, so seconds measured minutes apart do not compare (a plain step timed while the machine
was quiet made every later draft look like a loss). `PassCosts` therefore keeps every cost as a
multiple of a plain step measured close by: the median of the last REFERENCE_SAMPLES plain steps;
while an answer drafts, one round in REFERENCE_EVERY is a plain step that keeps it current, and
a request after IDLE_S without any round takes one of its own (its second round).
Costs are keyed by what was done: d by tokens drafted, t by rows verified; draft trees
(engine/tree.py) have tables of their own (their pass masks attention differently), so a tree
verifying 6 nodes 4 deep never prices a chain. Each table holds, per size, the median of the
last WINDOW samples; a size not measured yet is interpolated between measured neighbours, or
scaled from the nearest one (t by PRIOR_SLOPE: t(n) ~ t(1) (1 + 0.1 (n-1)); d in proportion to
k); choosing such a k measures it. A round is never priced below a plain step (it reads every
weight one reads), so the expected gain of k drafted tokens is at most k + 1.

The ai (and a, their level over all positions) are engine/acceptance.py's: from this request's
rounds and the drafter's earlier requests with as many images, position by position.

Stopping on thin evidence: while fewer than THIN_EVIDENCE of the request's drafted tokens have
been judged, k is chosen at optimistic ai, each OPTIMISM standard errors higher (sqrt(a (1 - a) /
(n + 1)) over those n tokens and the pseudo-tokens); where drafting loses at the estimate but
not at that optimistic a, the round drafts one token (a fixed k: k) to learn more.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass

from engine.acceptance import History, RequestAcceptance
from engine.stats import PAUSED, REFERENCE

WINDOW = 15
PRIOR_SLOPE = 0.1
PROBE_EVERY = 16
FIRST_K = 4  # before anything is measured
THIN_EVIDENCE = 16
OPTIMISM = 1.0  # standard errors added to the acceptance estimate before choosing k
REFERENCE_SAMPLES = 3  # plain steps whose median is the unit of every cost
REFERENCE_EVERY = 32  # while drafting, one round in this many is a plain step (when no other was)
FIXED_FLOOR = 0.1  # a fixed k pauses below this acceptance estimate (after THIN_EVIDENCE tokens judged)
THIN_COSTS = 3  # drafting rounds of a drafter measured before its cost alone may pause it
IDLE_S = 5.0  # an engine idle this long may have a different load: the next request times a plain step


class Curve:
    """Recent costs of one kind of work by its size (rows verified, tokens drafted, a tree's
    rows by depth): per size the median of the last WINDOW samples; between measured sizes
    interpolated, beyond them scaled from the nearest by `prior(size)`."""

    def __init__(self, prior=float):
        self.samples: dict[int, deque] = {}
        self.medians: dict[int, float] = {}  # size -> the median of its samples, kept as they come
        self.prior = prior

    def add(self, size: int, value: float) -> None:
        samples = self.samples.setdefault(size, deque(maxlen=WINDOW))
        samples.append(value)
        self.medians[size] = statistics.median(samples)  # read every round for every k: not recomputed there

    def at(self, size: float) -> float | None:
        if size in self.medians:
            return self.medians[size]
        below = max((m for m in self.samples if m < size), default=None)
        above = min((m for m in self.samples if m > size), default=None)
        if below is not None and above is not None:
            low, high = self.at(below), self.at(above)
            return low + (high - low) * (size - below) / (above - below)
        nearest = below if below is not None else above
        return None if nearest is None else self.at(nearest) * self.prior(size) / self.prior(nearest)


def _prior(rows: float) -> float:
    return 1 + PRIOR_SLOPE * (rows - 1)


@dataclass
class Round:
    """One decode round as the cost tables see it."""

    drafter: str | None
    rows: int  # rows the target pass verified: the last committed token plus every draft node
    depth: int  # tokens drafted in a chain; a tree's depth
    tree: bool
    draft_s: float
    verify_s: float
    round_s: float


class PassCosts:
    """Costs measured on one engine and shared by its requests, each a multiple of a plain step
    measured close by (see the module's docstring), and each drafter's acceptance over past requests."""

    def __init__(self):
        self.plain_s: deque = deque(maxlen=REFERENCE_SAMPLES)  # seconds of the latest plain steps
        self.rounds = 0  # rounds recorded on this engine
        self.last_plain = None  # the round of the latest plain step
        self.last_round_at = float("-inf")  # time.monotonic() of the latest round recorded
        self.pending: deque = deque(maxlen=WINDOW)  # rounds before any plain step: priced by the first one
        self.verify = Curve(_prior)  # chain passes, by rows
        self.tree_verify = Curve(_prior)  # tree passes, by rows
        self.draft: dict[str, Curve] = {}  # drafter -> drafting a chain, by tokens
        self.tree_draft: dict[str, Curve] = {}  # drafter -> drafting a tree, by depth
        self.tree_rows: dict[str, Curve] = {}  # drafter -> rows its trees verify, by depth
        self.overhead: deque = deque(maxlen=WINDOW)
        self.history = History()  # each drafter's acceptance over earlier requests

    def record_round(self, done: Round) -> None:
        self.rounds += 1
        self.last_round_at = time.monotonic()
        if done.rows == 1:
            self.plain_s.append(done.verify_s)
            self.last_plain = self.rounds
        self.pending.append(done)
        if self.plain_s and statistics.median(self.plain_s) > 0:
            unit = statistics.median(self.plain_s)
            while self.pending:
                self._add(self.pending.popleft(), unit)

    def _add(self, done: Round, unit: float) -> None:
        self.overhead.append(max(0.0, done.round_s - done.draft_s - done.verify_s) / unit)
        if done.tree:
            self.tree_verify.add(done.rows, done.verify_s / unit)
            if done.drafter is not None:
                self.tree_draft.setdefault(done.drafter, Curve()).add(done.depth, done.draft_s / unit)
                self.tree_rows.setdefault(done.drafter, Curve()).add(done.depth, done.rows)
            return
        self.verify.add(done.rows, done.verify_s / unit)
        if done.drafter is not None and done.rows > 1:
            self.draft.setdefault(done.drafter, Curve()).add(done.rows - 1, done.draft_s / unit)

    def begin_request(self) -> None:
        """A request starts. After IDLE_S without a round the machine's load may have changed, so
        the request's rounds wait for a plain step of its own before they are priced."""
        if time.monotonic() - self.last_round_at > IDLE_S:
            self.plain_s.clear()
            self.last_plain = None

    def needs_reference(self) -> bool:
        """No plain step among the last REFERENCE_EVERY rounds: the next drafting round should be one."""
        return self.last_plain is None or self.rounds - self.last_plain >= REFERENCE_EVERY - 1

    def round_cost(self, drafter: str, k: int, tree: bool = False) -> float | None:
        """A round drafting k tokens (a tree k deep), drafting and verifying, in plain steps;
        None while something it needs was never measured."""
        if k == 0:
            return self.verify.at(1)
        if tree:
            rows = self.tree_rows[drafter].at(k) if drafter in self.tree_rows else None
            draft, verify = self.tree_draft.get(drafter), rows and self.tree_verify.at(rows)
        else:
            draft, verify = self.draft.get(drafter), self.verify.at(k + 1)
        draft_cost = draft.at(k) if draft else None
        return None if draft_cost is None or verify is None else draft_cost + verify

    def draft_rounds(self, drafter: str, tree: bool = False) -> int:
        """How many of `drafter`'s drafting rounds the cost tables hold (at most WINDOW a size)."""
        curve = (self.tree_draft if tree else self.draft).get(drafter)
        return sum(len(samples) for samples in curve.samples.values()) if curve else 0

    def overhead_cost(self) -> float:
        return statistics.median(self.overhead) if self.overhead else 0.0

    def reset(self) -> None:
        """Forget everything measured (after a warm-up: cold-start timings and a made-up prompt's
        acceptance say nothing about the requests to come)."""
        self.__init__()


def acceptance_at(a: float | list[float], position: int) -> float:
    """The acceptance of draft position `position` (1, 2, ...): one per-token figure, or one per
    position (a[i]: position i + 1, the last repeated beyond the list)."""
    return a if isinstance(a, (int, float)) else a[min(position, len(a)) - 1]


def expected_tokens(a: float | list[float], k: int) -> float:
    """Tokens a round that drafts k yields, bonus token included, at acceptance a (acceptance_at)."""
    total, reach = 1.0, 1.0
    for position in range(1, k + 1):
        reach *= acceptance_at(a, position)
        total += reach
    return total


def rates(costs: PassCosts, drafter: str, a: float | list[float], max_k: int,
          tree: bool = False) -> dict[int, float] | None:
    """Expected tokens per plain step's time of each k in 0..max_k at acceptance a (one figure, or
    one per position); None while a cost is unmeasured."""
    overhead, out = costs.overhead_cost(), {}
    tokens = reach = 1.0  # expected_tokens(a, k), and the chance that the k-th draft token is accepted
    for k in range(max_k + 1):
        cost = costs.round_cost(drafter, k, tree)
        if cost is None:
            return None
        if k == 0:
            plain_cost = cost
        else:  # a verify pass reads every weight a plain step reads: a round priced below one plain
            cost = max(cost, plain_cost)  # step is noise (a slow first plain step pricing earlier rounds)
            reach *= acceptance_at(a, k)
            tokens += reach
        out[k] = tokens / max(cost + overhead, 1e-9)
    return out


@dataclass
class Choice:
    k: int
    gain: float | None  # expected speed of drafting (at k, or at the best k when paused) over plain


def best_k(costs: PassCosts, drafter: str, a: float | list[float], max_k: int, tree: bool = False,
           fixed: int | None = None) -> Choice | None:
    """The k with the most expected tokens per second (a fixed k, or 0 where it loses); None
    while a cost is unmeasured."""
    rate = rates(costs, drafter, a, max(max_k, fixed or 0), tree)
    if rate is None:
        return None
    drafting = fixed or max(range(1, max_k + 1), key=rate.get, default=1)
    gain = rate[drafting] / rate[0]
    return Choice(drafting if gain > 1 else 0, gain)


class DraftLength:
    """One request's draft length: `k` now, `reason` in a user's words; `update(...)` after each round."""

    def __init__(self, draft_tokens: int | None, adaptive: bool, max_draft_tokens: int,
                 costs: PassCosts | None, drafter: str | None, num_images: int = 0):
        self.fixed, self.adaptive, self.max_k = draft_tokens, adaptive, max_draft_tokens
        self.costs = costs if costs is not None else PassCosts()
        self.drafter = drafter
        self.seen = RequestAcceptance(self.costs.history, drafter, num_images)
        self.tree = False  # whether the latest drafted round was a tree
        self.plain_rounds = 0  # rounds in a row that drafting has been paused
        self.costs.begin_request()
        self.k, self.reason = (0, "plain decoding") if drafter is None else (draft_tokens or FIRST_K, "")
        if drafter is not None and adaptive:
            self.reason = _adaptive(self.k)
        elif drafter is not None:
            self._choose()

    @property
    def acceptance(self) -> float:
        """a over all positions (engine/acceptance.py)."""
        return self.seen.level

    @property
    def positions(self) -> int:
        return max(self.max_k, self.fixed or 0, 1)

    def update(self, rows: int, depth: int, num_accepted: int, tree: bool, draft_s: float, verify_s: float,
               round_s: float, alone: bool = True) -> int:
        """Learn one round: `rows` verified (1 + draft nodes), drafted `depth` deep, `num_accepted`
        kept; seconds drafting, verifying and in all. Returns the next k. A round stepped beside other
        answers (not `alone`: engine/worker.py's shared rounds) has their work in its times: they are
        not recorded as the engine's pass costs."""
        if alone:
            self.costs.record_round(Round(self.drafter, rows, depth, tree, draft_s, verify_s, round_s))
        if depth:
            self.tree = tree
            self.seen.record(depth, num_accepted)
        if self.drafter is None:
            return self.k
        if self.adaptive:
            if depth:
                self.k = min(self.k + 2, self.max_k) if num_accepted == depth else max(self.k - 1, 1)
                self.reason = _adaptive(self.k)
        else:
            self._choose()
        return self.k

    def finish(self) -> None:
        """Add this request's counts to the drafter's history on the engine (its image context's)."""
        self.seen.finish()

    def _choose(self) -> None:
        if self.fixed:  # decided on the answer's tokens alone, so a seeded answer stays reproducible
            if self.seen.judged >= THIN_EVIDENCE and self.acceptance < FIXED_FLOOR:
                self._paused(None)
            else:
                self.k, self.reason, self.plain_rounds = self.fixed, f"draft length {self.fixed} (fixed)", 0
            return
        estimate = self.seen.by_position(self.positions)
        choice = best_k(self.costs, self.drafter, estimate, self.max_k, self.tree, self.fixed)
        if choice is None:  # a cost never measured: draft, and measure it (and a plain step to price it by)
            self.k = self.fixed or FIRST_K
            self.reason = f"draft length {self.k} (fixed)" if self.fixed else \
                f"draft length {self.k}: a first guess, until the costs are measured"
            if not self.costs.pending:
                return
        elif self.seen.judged < THIN_EVIDENCE and (hopeful := best_k(
                self.costs, self.drafter, self.seen.optimistic(estimate, OPTIMISM), self.max_k, self.tree,
                self.fixed)).k:
            if choice.k:  # little seen yet: choose at the optimistic acceptance
                self._drafting(hopeful, "an acceptance at the high end of what the few tokens judged so far allow")
            else:
                self.k = self.fixed or 1
                self.reason = f"draft length {self.k}: too few tokens judged yet to tell whether drafting pays"
        elif choice.k:
            self._drafting(choice, f"an expected acceptance of {self.acceptance:.0%} (this drafter's earlier answers "
                                   "and this one's so far; not this answer's own acceptance)")
        elif self.costs.draft_rounds(self.drafter, self.tree) < THIN_COSTS:  # one slow round (a first call,
            self.k = FIRST_K  # a busy moment) cannot pause a drafter: measure a few more
            self.reason = f"draft length {self.k}: too few rounds measured yet to tell whether drafting pays"
        else:
            self._paused(choice)
            return
        self.plain_rounds = 0
        if self.costs.needs_reference():
            self.k, self.reason = 0, REFERENCE

    def _drafting(self, choice: Choice, acceptance: str) -> None:  # "× plain expected": app_ui/views.py EXPECTED reads it
        """Draft `choice.k`, chosen at `acceptance` (in words: which acceptance the rule assumed)."""
        self.k = choice.k
        self.reason = f"draft length {self.k} (fixed)" if self.fixed else \
            f"draft length {self.k}: the fastest at the measured costs and {acceptance} ({choice.gain:.2f}× plain expected)"

    def _paused(self, choice: Choice | None) -> None:
        """Plain steps, and 1 token every PROBE_EVERY; `choice`: the cost rule's (None: a fixed k rejected)."""
        self.plain_rounds += 1
        probe = self.plain_rounds % PROBE_EVERY == 0
        self.k = 1 if probe else 0
        why = (f"draft length {self.fixed}: almost every drafted token was rejected" if choice is None else
               f"the best draft length was {choice.gain:.2f}× plain expected")
        self.reason = (f"{PAUSED}; " + ("drafting 1 token to see whether it pays again" if probe else
                                        f"{why}; 1 token is tried again every {PROBE_EVERY} steps"))


def _adaptive(k: int) -> str:
    return f"draft length {k} (adaptive: 2 longer after a fully accepted draft, 1 shorter after a rejection)"
