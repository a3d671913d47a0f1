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


def main(argv=None) -> int:
    """A long answer with a weak drafter against plain decoding, on the bundled model (or
    --preset / --model): the replay drafter at --acceptance, with k fixed and k from cost.

        python -m measure.replay [--acceptance 0.1] [--max-new-tokens 256] [--repeats 5] [--dtype bfloat16]

    The answer never stops early (no stop token), so it runs on repetitively past its end; rows
    are interleaved per repeat, medians reported."""
    import argparse
    import statistics
    from dataclasses import replace

    from engine.build import add_model_flags, build_engine, spec_from_args
    from engine.loop import DecodeSettings
    from measure.bench import demo_requests, request_messages
    from measure.bench_rows import interleaved, run_this

    parser = argparse.ArgumentParser(prog="python -m measure.replay", description=main.__doc__.split("\n\n")[0])
    add_model_flags(parser)
    parser.add_argument("--acceptance", type=float, default=0.1)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    engine = build_engine(replace(spec_from_args(args), drafters=()))
    messages = request_messages(demo_requests(1)[0])
    decode = DecodeSettings(max_new_tokens=args.max_new_tokens, stop_token_ids=frozenset({-1}))
    plain = run_this(engine, None, messages, decode, 0)  # also the warm-up
    engine.drafters["replay"] = ReplayDrafter(plain.token_ids, args.acceptance, engine.target.vocab_size,
                                              engine.target.placeholder_ids)
    rows = {"plain": (None, None), "replay, k = 4": ("replay", 4), "replay, k from cost": ("replay", None)}
    runs = interleaved(args.repeats, rows, lambda _, name: run_this(engine, rows[name][0], messages,
                                                                    replace(decode, draft_tokens=rows[name][1]), 0))
    speeds = {name: [run.decode_tok_s for run in runs[name]] for name in rows}
    plain_speed = statistics.median(speeds["plain"])
    print(f"{args.max_new_tokens}-token answer, replay drafter at acceptance {args.acceptance}, "
          f"{args.repeats} interleaved repeats (median decode tok/s)")
    for name, values in speeds.items():
        m = runs[name][-1]
        print(f"| {name} | {statistics.median(values):.1f} tok/s | {statistics.median(values) / plain_speed:.3f}x plain "
              f"| drafted {m.drafted}, accepted {m.accepted}, plain steps {m.draft_lengths.count(0)} of "
              f"{len(m.draft_lengths)} | identical: {m.token_ids == plain.token_ids} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
