"""A/B: one turn answered plainly, then speculatively, by the same engine, and compared.

    for event in run_ab(BuiltIn(engine), messages, drafter="text"):
        if isinstance(event, ABProgress):
            ...  # live: both sides' text and statistics so far
        else:
            result = event  # ABResult, always the last event

Both sides are ordinary requests to a backend (engine/backend.py; the built-in engine's one
decode loop), run one after the other: the plain run has finished before the speculative one
starts, so each side's Stats time only that side's work. The backend decodes on its own thread
(engine/worker.py), so what the caller does between events is not in the figures.

Conventions:
- decode_speedup = speculative decode_tok_s / plain decode_tok_s: the rate speculative decoding
  changes (prefill is the same work on both sides). None when the plain side decoded nothing.
- time_ratio = plain total_s / speculative total_s: the whole answer, prefill included;
  above 1 means the speculative answer finished sooner.
- identical compares token ids (the texts when the backend gives no ids). With greedy sampling it must be True (the engine's exactness
  guarantee); with temperature > 0 the two sides draw differently and usually differ.
- A stop (the `stop` event) ends the A/B early: the result has stopped=True, no speedup, no
  comparison (identical and first_difference are None: the answers were not both finished),
  and the speculative side may not have run (its `done` is False).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from engine.backend import Backend, BuiltIn, Request
from engine.engine import RequestError
from engine.loop import Chunk, DecodeSettings, Done
from engine.sampling import SamplingSettings
from engine.stats import Stats

DIFFERENCE_TOKENS = 8  # how much of each side `Difference` shows from the first differing token
DIFFERENCE_CHARS = 32  # the same, when the sides are compared as text


@dataclass
class Side:
    """One side's answer as it streams: text, ids, where each id came from, live statistics."""

    mode: str  # "plain" or "speculative"
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)  # "draft" (accepted draft token) or "target"
    spans: list[tuple[str, str]] = field(default_factory=list)  # the text in runs of one origin
    stats: Stats | None = None
    done: bool = False

    def update(self, event: Chunk | Done) -> None:
        self.stats = event.stats
        if isinstance(event, Chunk):
            self.text += event.text
            self.token_ids += event.token_ids
            self.origins += event.origins
            for piece, origin in event.spans:  # a run continues while the origin stays the same
                if self.spans and self.spans[-1][1] == origin:
                    self.spans[-1] = (self.spans[-1][0] + piece, origin)
                else:
                    self.spans.append((piece, origin))
        else:
            self.text, self.token_ids, self.done = event.text, list(event.token_ids), True


@dataclass
class ABProgress:
    running: str  # the side being decoded: "plain" or "speculative"
    plain: Side
    speculative: Side


@dataclass
class Difference:
    index: int  # the first token index at which the answers differ (a character index when compared as text)
    char_index: int  # where that token starts in the answer text (the common prefix's length)
    plain: str  # the plain answer from that token on (a few tokens; "" if it ended there)
    speculative: str  # the same for the speculative answer


@dataclass
class ABResult:
    plain: Side
    speculative: Side
    decode_speedup: float | None
    time_ratio: float | None
    identical: bool | None  # None when stopped
    first_difference: Difference | None  # None when identical or stopped
    stopped: bool = False

    def as_dict(self) -> dict:
        """Plain data (answers, statistics, comparison) for JSON."""
        sides = {side.mode: {"text": side.text, "stats": side.stats.as_dict() if side.stats else None}
                 for side in (self.plain, self.speculative)}
        first_difference = asdict(self.first_difference) if self.first_difference else None
        return {**sides, "decode_speedup": self.decode_speedup, "time_ratio": self.time_ratio,
                "identical": self.identical, "first_difference": first_difference, "stopped": self.stopped}


def run_ab(
    backend: Backend,
    messages: list[dict],
    drafter: str | None = None,
    sampling: SamplingSettings = SamplingSettings(),
    decode: DecodeSettings = DecodeSettings(),
    stop: threading.Event | None = None,
    max_image_tokens: int | None = None,
    against: Backend | None = None,
) -> Iterator[ABProgress | ABResult]:
    """Answer the conversation's last user turn plainly, then with `drafter` (default: the
    backend's default drafter), each image at most `max_image_tokens` tokens (engine.prepare);
    an ABProgress after every chunk, then one ABResult.

    `against`: another backend instead. The first side ("plain" in the result) is `backend` with
    `drafter` (None: as it decodes by default), the second ("speculative") is `against`, as it
    decodes by default; the answers are compared as text unless both are the same backend."""
    if against is None:
        drafter = drafter or backend.capabilities.default_drafter
        if drafter is None:
            raise RequestError("A/B needs a drafter and none is loaded")
    plain, speculative = Side("plain"), Side("speculative")
    runs = ((plain, backend, None), (speculative, backend, drafter)) if against is None else \
        ((plain, backend, drafter), (speculative, against, None))
    for side, side_backend, side_drafter in runs:
        if stop is not None and stop.is_set():
            break
        for event in side_backend.stream(Request(messages, side_drafter, sampling, decode, stop,
                                                 max_image_tokens=max_image_tokens)):
            side.update(event)
            yield ABProgress(side.mode, plain, speculative)
    same = against is None or against is backend
    yield compare(backend.engine.target.tokenizer if same and isinstance(backend, BuiltIn) else None, plain,
                  speculative)


def compare(tokenizer, plain: Side, speculative: Side) -> ABResult:
    """Speedup and identity of two finished sides (see the module's conventions); with no
    `tokenizer` the texts are compared, character by character."""
    stopped = not (plain.done and speculative.done) or "stopped" in (
        plain.stats.finish_reason, speculative.stats.finish_reason)
    if stopped:
        return ABResult(plain, speculative, None, None, identical=None, first_difference=None, stopped=True)
    if tokenizer is None:
        index = first_difference_index(plain.text, speculative.text)
        difference = None if index is None else Difference(
            index, index, plain.text[index:index + DIFFERENCE_CHARS],
            speculative.text[index:index + DIFFERENCE_CHARS])
    else:
        index = first_difference_index(plain.token_ids, speculative.token_ids)
        difference = None if index is None else Difference(
            index=index,
            char_index=len(tokenizer.decode(plain.token_ids[:index], skip_special_tokens=True)),
            plain=tokenizer.decode(plain.token_ids[index:index + DIFFERENCE_TOKENS], skip_special_tokens=True),
            speculative=tokenizer.decode(speculative.token_ids[index:index + DIFFERENCE_TOKENS],
                                         skip_special_tokens=True),
        )
    decode_speedup = _ratio(speculative.stats.decode_tok_s, plain.stats.decode_tok_s)
    time_ratio = _ratio(plain.stats.total_s, speculative.stats.total_s)
    return ABResult(plain, speculative, decode_speedup, time_ratio, identical=index is None,
                    first_difference=difference)


def first_difference_index(a: list[int] | str, b: list[int] | str) -> int | None:
    """The first index where the sequences differ (a prefix differs at the shorter's end)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None
