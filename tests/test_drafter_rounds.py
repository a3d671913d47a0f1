"""Per-round work of the LM drafters (engine/drafters/language_model.py) grows with the draft, not the answer:
a round reads the tokens committed since the last one and the k it drafted, never the whole answer."""

from __future__ import annotations

from engine.build import EngineSpec, build_engine
from engine.sampling import Sampler, SamplingSettings
from tests.helpers import DEMO_TARGET, DEMO_TEXT_DRAFTER


class CountingAnswer(list):
    """The answer so far; counts the entries read from it (indexing, slicing, iterating)."""

    reads = 0

    def __getitem__(self, index):
        value = super().__getitem__(index)
        CountingAnswer.reads += len(value) if isinstance(index, slice) else 1
        return value

    def __iter__(self):
        for value in super().__iter__():
            CountingAnswer.reads += 1
            yield value


def test_a_round_reads_what_is_new_not_the_whole_answer():
    engine = build_engine(EngineSpec(DEMO_TARGET, drafters=(DEMO_TEXT_DRAFTER,)))
    prompt = engine.prepare([{"role": "user", "content": [{"type": "text", "text": "Describe a red circle."}]}])
    session = next(iter(engine.drafters.values())).begin(prompt, None)
    sampler, k = Sampler(SamplingSettings()), 4
    answer, reads = CountingAnswer([42]), []  # the prefill's token: every round has one new token at least
    for round_number in range(120):
        CountingAnswer.reads = 0
        draft = session.propose(answer, k, sampler)
        reads.append(CountingAnswer.reads)
        accepted = round_number % (k + 1)  # 0..k of the drafts, then the target's own token
        answer.extend(draft.token_ids[:accepted] + [(round_number * 7) % 100 + 10])
        session.accept(accepted)
    assert len(answer) > 300
    assert max(reads) <= 2 * (k + 1), reads  # before: the whole answer every round (over 300 reads at the end)
