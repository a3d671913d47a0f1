"""A drafter whose acceptance is set, not learned: it proposes a recorded answer (the target's
own greedy answer) with each answer position corrupted at a chosen rate, for measuring what a
drafter of known acceptance delivers (measure/realscale.py, tests).

Position i of the answer is corrupted when a hash of (seed, i) falls under `1 - acceptance`;
the same positions in every run, whatever k. A corrupted token is replaced by another id that
is not an image placeholder, so the target rejects it in greedy decoding; the rows after a
rejection are accepted again as long as the answer follows the recording. Each drafted token is
thus accepted with probability `acceptance` given that the ones before it were, the `a` of the
cost model (engine/draft_length.py).

With random weights in bfloat16 a verify pass over k+1 tokens can flip a near-tie argmax that a
one-token pass decides the other way, so the engine's speculative answer can leave the plain
one: record the answer the engine itself gives with this drafter (`record_fixed_point`).
"""

from __future__ import annotations

import hashlib

from engine.drafters.base import Draft
from engine.runner import NO_READS


class ReplayDrafter:
    kind = "replay"
    reads = NO_READS

    def __init__(self, answer: list[int], acceptance: float, vocab_size: int, placeholder_ids=frozenset(),
                 seed: int = 0, name: str | None = None):
        self.answer, self.acceptance = list(answer), acceptance
        self.name = name or f"replay-{acceptance:.2f}"
        self.proposals = [self._corrupt(i, t, seed, vocab_size, frozenset(placeholder_ids))
                          for i, t in enumerate(self.answer)]

    def _corrupt(self, position: int, token: int, seed: int, vocab_size: int, placeholders) -> int:
        digest = hashlib.sha256(f"{seed}:{position}".encode()).digest()
        if int.from_bytes(digest[:8], "big") / 2 ** 64 < self.acceptance:
            return token
        other = (token + 1 + digest[8]) % vocab_size
        while other in placeholders or other == token:
            other = (other + 1) % vocab_size
        return other

    def corrupted_positions(self) -> int:
        return sum(p != t for p, t in zip(self.proposals, self.answer))

    def begin(self, prompt, target_state):
        return self

    def propose(self, generated: list[int], k: int, sampler) -> Draft:
        return Draft(self.proposals[len(generated):len(generated) + k])

    def accept(self, num_accepted: int) -> None:
        pass


def record_fixed_point(answer_with, plain_answer: list[int], tries: int = 3) -> list[int]:
    """The answer `answer_with(recording)` gives when replaying itself: start from the plain
    answer and re-record until the engine's answer with the replay drafter equals its recording
    (at most `tries` rounds; the last answer otherwise)."""
    recording = plain_answer
    for _ in range(tries):
        answer = answer_with(recording)
        if answer == recording:
            break
        recording = answer
    return recording
