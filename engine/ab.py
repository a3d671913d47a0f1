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
  changes (prefill is the same work on both sides). None when either side's speed is not
  measured (Stats.speed_measured: an answer of one or two tokens), never a ratio to zero.
- time_ratio = plain total_s / speculative total_s: the whole answer, prefill included;
  above 1 means the speculative answer finished sooner.
- identical compares token ids (the texts when the backend gives no ids). With greedy sampling it must be True (the engine's exactness
  guarantee); with temperature > 0 the two sides draw differently and usually differ.
- verdict: the conclusion in words (`Verdict.text`), derived from the measured figures only, so
  that it cannot contradict them: decode_speedup = tokens per target forward / the time of a
  speculative round in plain steps (both sides' decode_s / target_forwards), an identity of the
  two sides' statistics; acceptance as Stats.acceptance; the drafter's cost per drafted token
  from the engine's measured costs; the machine's load average per core over the A/B.
- A stop (the `stop` event) ends the A/B early: the result has stopped=True, no speedup, no
  comparison (identical and first_difference are None: the answers were not both finished),
  and the speculative side may not have run (its `done` is False).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from engine.backend import Backend, BuiltIn, Request
from engine.engine import RequestError
from engine.loop import Chunk, DecodeSettings, Done
from engine.sampling import SamplingSettings
from engine.stats import PAUSED, Stats

DIFFERENCE_TOKENS = 8  # how much of each side `Difference` shows from the first differing token
DIFFERENCE_CHARS = 32  # the same, when the sides are compared as text
ABOUT_THE_SAME = 0.05  # a speedup within this of 1 is "about as fast"
BUSY = 1.0  # load average per core above which timings are called noisy


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
class Verdict:
    """The A/B's conclusion: a headline and reasons, each naming a measured figure."""

    headline: str
    reasons: list[str] = field(default_factory=list)
    round_cost: float | None = None  # a speculative round's time in plain steps (decode_s / target_forwards)
    draft_cost: float | None = None  # drafting one token, in plain steps (the engine's measured costs)
    load_per_core: float | None = None  # the machine's 1-minute load average per core during the A/B

    @property
    def text(self) -> str:
        return " ".join([self.headline + ("." if self.reasons else "")] + [r[0].upper() + r[1:] + "." for r in self.reasons])


@dataclass
class ABResult:
    plain: Side
    speculative: Side
    decode_speedup: float | None
    time_ratio: float | None
    identical: bool | None  # None when stopped
    first_difference: Difference | None  # None when identical or stopped
    stopped: bool = False
    verdict: Verdict | None = None

    def as_dict(self) -> dict:
        """Plain data (answers, statistics, comparison) for JSON."""
        sides = {side.mode: {"text": side.text, "stats": side.stats.as_dict() if side.stats else None}
                 for side in (self.plain, self.speculative)}
        first_difference = asdict(self.first_difference) if self.first_difference else None
        verdict = {**asdict(self.verdict), "text": self.verdict.text} if self.verdict else None
        return {**sides, "decode_speedup": self.decode_speedup, "time_ratio": self.time_ratio,
                "identical": self.identical, "first_difference": first_difference, "stopped": self.stopped,
                "verdict": verdict}


def run_ab(backend: Backend, messages: list[dict], drafter: str | None = None,
           sampling: SamplingSettings = SamplingSettings(), decode: DecodeSettings = DecodeSettings(),
           stop: threading.Event | None = None, max_image_tokens: int | None = None,
           against: Backend | None = None) -> Iterator[ABProgress | ABResult]:
    """Answer the conversation's last user turn plainly, then with `drafter` (default: the
    backend's default drafter), each image at most `max_image_tokens` tokens (engine.prepare);
    an ABProgress after every chunk, then one ABResult.

    `against`: another backend instead. The first side ("plain" in the result) is `backend` with
    `drafter` (None: as it decodes by default), the second ("speculative") is `against`, as it
    decodes by default (its default drafter: llama.cpp's draft model, none for a server that
    decides); the answers are compared as text unless both are the same backend."""
    if against is None:
        drafter = drafter or backend.capabilities.default_drafter
        if drafter is None:
            raise RequestError("A/B needs a drafter and none is loaded")
    plain, speculative = Side("plain"), Side("speculative")
    runs = ((plain, backend, None), (speculative, backend, drafter)) if against is None else \
        ((plain, backend, drafter), (speculative, against, against.capabilities.default_drafter))
    load_before = os.getloadavg()[0]
    for side, side_backend, side_drafter in runs:
        if stop is not None and stop.is_set():
            break
        for event in side_backend.stream(Request(messages, side_drafter, sampling, decode, stop,
                                                 max_image_tokens=max_image_tokens)):
            side.update(event)
            yield ABProgress(side.mode, plain, speculative)
    load = (load_before + os.getloadavg()[0]) / 2 / (os.cpu_count() or 1)
    built_in = backend.engine if isinstance(backend, BuiltIn) and (against is None or against is backend) else None
    yield compare(built_in.target.tokenizer if built_in else None, plain, speculative, sampling.temperature, load,
                  _draft_cost(built_in, speculative.stats) if built_in else None, verdict_of=against is None)


def compare(tokenizer, plain: Side, speculative: Side, temperature: float = 0.0, load_per_core: float | None = None,
            draft_cost: float | None = None, verdict_of: bool = True) -> ABResult:
    """Speedup, identity and (`verdict_of`: plain against speculative decoding of one engine) the
    verdict of two finished sides (see the module's conventions); with no `tokenizer` the texts
    are compared, character by character."""
    stopped = not (plain.done and speculative.done) or "stopped" in (
        plain.stats.finish_reason, speculative.stats.finish_reason)
    if stopped:
        return ABResult(plain, speculative, None, None, identical=None, first_difference=None, stopped=True,
                        verdict=Verdict("Stopped before both sides finished: no speedup or comparison to report"))
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
    measured = plain.stats.speed_measured and speculative.stats.speed_measured
    decode_speedup = _ratio(speculative.stats.decode_tok_s, plain.stats.decode_tok_s) if measured else None
    time_ratio = _ratio(plain.stats.total_s, speculative.stats.total_s)
    result = ABResult(plain, speculative, decode_speedup, time_ratio, identical=index is None,
                      first_difference=difference)
    if verdict_of:
        result.verdict = verdict(result, temperature, load_per_core, draft_cost)
    return result


def verdict(result: ABResult, temperature: float, load_per_core: float | None, draft_cost: float | None) -> Verdict:
    """The conclusion of a finished A/B, from its figures (see the module's conventions)."""
    plain, spec = result.plain.stats, result.speculative.stats
    found = Verdict("", load_per_core=load_per_core, draft_cost=draft_cost)
    speedup = result.decode_speedup
    passes_unknown = "target_forwards" in spec.unknown + plain.unknown  # e.g. llama.cpp: engine/backends/llamacpp.py
    if speedup is None or not passes_unknown and not (spec.target_forwards and plain.target_forwards):
        found.headline = "Too short to compare: an answer of one token has no decoding steps to time"
        return _identity(found, result, temperature)
    pace = ("faster than" if speedup >= 1 + ABOUT_THE_SAME else
            "slower than" if speedup <= 1 - ABOUT_THE_SAME else "about as fast as")
    found.headline = f"Speculative decoding was {pace} plain decoding: {speedup:.2f}× the decode speed"
    accepted = "" if spec.acceptance is None else f" (acceptance {spec.acceptance:.0%}: {spec.accepted} of {spec.drafted} drafted tokens kept)"
    if passes_unknown:
        found.reasons.append(f"the backend does not report its target passes{accepted}, so the speedup is not "
                             "split into tokens per pass and the cost of a round")
        found.reasons += [spec.fallback_reason] if spec.fallback_reason else []
        return _busy_and_identity(found, result, temperature, load_per_core)
    found.round_cost = (spec.decode_s / spec.target_forwards) / (plain.decode_s / plain.target_forwards)
    tokens = spec.tokens_per_forward
    found.reasons.append(f"each target pass yielded {tokens:.2f} tokens{accepted}, and each round took "
                         f"{found.round_cost:.2f}× a plain step: {tokens:.2f} / {found.round_cost:.2f} = {speedup:.2f}×")
    if spec.drafting_paused or spec.drafted == 0:
        found.reasons.append(f"{PAUSED} by the end of the answer, so most steps were plain ones")
    elif draft_cost is not None:
        found.reasons.append(f"drafting one token cost {draft_cost:.2f} of a plain step")
    if result.time_ratio is not None and (result.time_ratio >= 1) != (speedup >= 1):
        found.reasons.append(f"the whole answer, prefill and the drafter's own start included, was "
                             f"{result.time_ratio:.2f}× as fast")
    return _busy_and_identity(found, result, temperature, load_per_core)


def _busy_and_identity(found: Verdict, result: ABResult, temperature: float, load_per_core: float | None) -> Verdict:
    if load_per_core is not None and load_per_core > BUSY:
        found.reasons.append(f"the machine was busy (load {load_per_core:.1f} per core): timings vary from run to run")
    return _identity(found, result, temperature)


def _identity(found: Verdict, result: ABResult, temperature: float) -> Verdict:
    if result.identical:
        found.reasons.append("the answers are identical")
    elif temperature > 0:
        found.reasons.append(f"the answers differ: at temperature {temperature:g} each side samples its own tokens")
    else:
        found.reasons.append("the answers differ although decoding was greedy: that is a bug, please report it")
    return found


def _draft_cost(engine, stats: Stats | None) -> float | None:
    """Drafting one token at the answer's mean draft length, in plain steps (engine/draft_length.py)."""
    lengths = [k for k in (stats.draft_lengths if stats else []) if k > 0]
    curve = engine.costs.draft.get(stats.drafter) if stats and stats.drafter else None
    if not lengths or curve is None:
        return None
    k = sum(lengths) / len(lengths)
    cost = curve.at(k)
    return None if cost is None else cost / k


def first_difference_index(a: list[int] | str, b: list[int] | str) -> int | None:
    """The first index where the sequences differ (a prefix differs at the shorter's end)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None
