"""What a drafter's next tokens are expected to be worth: the acceptance the draft-length rule
(engine/draft_length.py) prices each round with.

a, the request's level: this request's rounds (accepted tokens / tokens that met a verdict: the
accepted ones and the first rejected one of each round), older rounds decaying by DECAY each
round, plus PRIOR_WEIGHT pseudo-tokens at the drafter's acceptance over earlier requests with as
many images (`image_context`: 0, 1, 2, 3 or more; pulled towards 0.5 by HISTORY_PRIOR
pseudo-tokens, so that a few early tokens, a warm-up's say, cannot fix it at 0 and keep a short
answer from ever drafting).

ai, position by position (the chance that the i-th draft token is accepted when the ones before
it were): this request's counts at position i plus POSITION_WEIGHT pseudo-tokens at a x si, where
si, the shape, is the drafter's acceptance at position i over those earlier requests over its
acceptance at all positions (1 where they say nothing). So a drafter that always accepts alike is
priced at a everywhere, and one whose later tokens fare worse is priced so from its first round.

Both the image count and the shape matter: the smol demo's EAGLE-3 drafter accepted 0.6-0.8 of
its tokens on picture turns and 0.1-0.3 on text turns, and fewer the deeper the position (0.46 /
0.28 / 0.21 / 0.13 at k = 4 over its bench's requests). With one a over all requests, text turns
began by drafting 7 tokens a round; with one a per image count and no shape, picture turns drafted
8 where 3 paid (models/demo/README.md). These are the rule's internal figures; what users see as
"acceptance" is Stats.acceptance (accepted / drafted over the answer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PRIOR_WEIGHT = 2.0  # pseudo-tokens at the drafter's history in a request's level
HISTORY_PRIOR = 8  # pseudo-tokens at acceptance 0.5 in a drafter's history
POSITION_WEIGHT = 4  # pseudo-tokens at a x si at each draft position
DECAY = 0.95  # a request's older rounds count this much less each round


def image_context(num_images: int) -> int:
    """Requests are told apart by their images, 0, 1, 2 or 3 or more (more images, longer prompts;
    a drafter that cannot see them, or reads them from the target, is worth different amounts):
    a drafter's history here, its recent speeds for `--drafter auto` (engine/auto.py)."""
    return min(num_images, 3)


@dataclass
class Counts:
    """Draft tokens by position (0: the first drafted): `accepted[i]` of `judged[i]` (accepted, or
    the first rejected one of a round)."""

    accepted: list[float] = field(default_factory=list)
    judged: list[float] = field(default_factory=list)

    def record(self, depth: int, num_accepted: int) -> None:
        """One round that drafted `depth` tokens (a chain, or a tree `depth` deep) and kept `num_accepted`."""
        reached = min(depth, num_accepted + 1)
        self._grow(reached)
        for i in range(reached):
            self.judged[i] += 1
            self.accepted[i] += i < num_accepted

    def decay(self, factor: float) -> None:
        self.accepted = [x * factor for x in self.accepted]
        self.judged = [x * factor for x in self.judged]

    def add(self, other: Counts) -> None:
        self._grow(len(other.judged))
        for i in range(len(other.judged)):
            self.accepted[i] += other.accepted[i]
            self.judged[i] += other.judged[i]

    def _grow(self, positions: int) -> None:
        while len(self.judged) < positions:
            self.accepted.append(0.0)
            self.judged.append(0.0)

    def total(self) -> tuple[float, float]:
        return sum(self.accepted), sum(self.judged)

    def by_position(self, positions: int, prior: list[float], weight: float) -> list[float]:
        """(accepted + weight x prior) / (judged + weight) at each of the first `positions`."""
        out = []
        for i in range(positions):
            accepted, judged = (self.accepted[i], self.judged[i]) if i < len(self.judged) else (0.0, 0.0)
            out.append((accepted + weight * prior[i]) / (judged + weight))
        return out


class History:
    """Each drafter's counts over the engine's earlier requests, by image context."""

    def __init__(self):
        self.counts: dict[tuple[str, int], Counts] = {}  # (drafter, image_context) -> counts
        self.shapes: dict[tuple[str, int, int], list[float]] = {}  # `shape`'s answers since the last record

    def record(self, drafter: str, context: int, counts: Counts) -> None:
        self.counts.setdefault((drafter, context), Counts()).add(counts)
        self.shapes.clear()

    def level(self, drafter: str, context: int = 0) -> float:
        """The drafter's acceptance over earlier requests of this context, pulled towards 0.5 by
        HISTORY_PRIOR pseudo-tokens."""
        accepted, judged = self.counts.get((drafter, context), Counts()).total()
        return (accepted + 0.5 * HISTORY_PRIOR) / (judged + HISTORY_PRIOR)

    def shape(self, drafter: str, context: int, positions: int) -> list[float]:
        """si for positions 1..`positions`: the drafter's acceptance at each over earlier requests
        of this context (pulled towards its acceptance at all positions by HISTORY_PRIOR
        pseudo-tokens) over that acceptance."""
        key = (drafter, context, positions)
        if key not in self.shapes:  # read every round; changed only by `record`
            overall = self.level(drafter, context)
            counts = self.counts.get((drafter, context), Counts())
            self.shapes[key] = [a / overall for a in counts.by_position(positions, [overall] * positions,
                                                                          HISTORY_PRIOR)]
        return self.shapes[key]


class RequestAcceptance:
    """One request's drafted tokens, and with its drafter's history what they say of the next round."""

    def __init__(self, history: History, drafter: str | None, num_images: int = 0):
        self.history, self.drafter = history, drafter
        self.context = image_context(num_images)  # which of the drafter's histories is its prior
        self.counts = Counts()  # this request's rounds, decayed
        self.request_counts = Counts()  # not decayed, for the history
        self.judged = 0  # tokens judged in this request

    def record(self, depth: int, num_accepted: int) -> None:
        """One round that drafted `depth` tokens and kept `num_accepted`."""
        self.counts.decay(DECAY)
        self.counts.record(depth, num_accepted)
        self.request_counts.record(depth, num_accepted)
        self.judged += num_accepted + (num_accepted < depth)

    @property
    def level(self) -> float:
        """a (the module's docstring)."""
        prior = self.history.level(self.drafter, self.context) if self.drafter else 0.5
        accepted, judged = self.counts.total()
        return (accepted + PRIOR_WEIGHT * prior) / (judged + PRIOR_WEIGHT)

    def by_position(self, positions: int) -> list[float]:
        """ai for positions 1..`positions` (the module's docstring)."""
        shape = self.history.shape(self.drafter, self.context, positions) if self.drafter else [1.0] * positions
        level = self.level
        return self.counts.by_position(positions, [min(1.0, level * s) for s in shape], POSITION_WEIGHT)

    def optimistic(self, estimate: list[float], errors: float) -> list[float]:
        """Each ai of `estimate` (by_position's) plus `errors` standard errors over this request's
        tokens and the pseudo-tokens."""
        n = self.judged + PRIOR_WEIGHT  # evidence is not decayed
        return [min(1.0, a + errors * math.sqrt(a * (1 - a) / (n + 1))) for a in estimate]

    def finish(self) -> None:
        """Add this request's counts to the drafter's history (its image context's)."""
        if self.drafter and self.judged:
            self.history.record(self.drafter, self.context, self.request_counts)
