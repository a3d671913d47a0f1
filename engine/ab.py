"""A/B: one turn answered plainly and speculatively by the same engine, on equal terms, and compared.

    for event in run_ab(BuiltIn(engine), messages, drafter="text"):
        if isinstance(event, ABProgress):
            ...  # live: both sides' text and statistics so far, then the timing repeats
        else:
            result = event  # ABResult, always the last event

Both sides are ordinary requests to a backend (engine/backend.py; the built-in engine's one
decode loop), each an answer of its own: each side's Stats time only that side's work, and
each answer is exactly what its mode gives alone. The backend decodes on its own thread
(engine/worker.py), so what the caller does between events is not in the figures.

Equal terms. The two sides run one after the other, so a burst of load (another program, another
visitor) would land on one of them. So the A/B answers in alternating pairs: plain then
speculative, then speculative then plain (ABBA: a load that rises or falls steadily weighs on
both alike): TIMING_S / the first pair's seconds pairs, at least MIN_PAIRS and at most MAX_PAIRS
(short answers, whose timings a moment's load moves most, get more). The first pair's
answers are the ones shown; the repeats are timed only, with the first pair's seed (one is drawn
when none is set), so each side repeats its own answer. Each pair gives one ratio of decode
speeds; their median is `decode_speedup`, their smallest and largest `spread`.

Conventions:
- decode_speedup = speculative decode_tok_s / plain decode_tok_s, the median over the pairs: the
  rate speculative decoding changes (prefill is the same work on both sides). None when either
  side's speed is not measured (Stats.speed_measured: an answer of one or two tokens), never a
  ratio to zero.
- measured: the speedup is a result only when the spread over at least MIN_PAIRS pairs excludes
  1 (every pair faster, or every pair slower); else the verdict says "no measurable difference".
  A speculative answer with no drafted token accepted is never faster: every token came from a
  target pass, as in plain decoding, so a higher speed there is the machine's noise.
- ceiling: the most a perfect, free drafter could give at the answer's draft lengths with the
  engine's measured pass costs (t(k+1) / t(1), engine/draft_length.py): each round would keep all
  k drafted tokens plus the bonus token, in one target pass over k + 1 rows and nothing else,
  sum(k + 1) / sum(t(k + 1)) in plain steps. A speedup the pairs agree on that is above it is
  flagged (`impossible`), not reported: the timings were disturbed.
- time_ratio = plain total_s / speculative total_s of the first pair: the whole answer, prefill
  included; above 1 means the speculative answer finished sooner. Shown only beside a measured
  decode speed.
- identical compares token ids (the texts when the backend gives no ids). With greedy sampling it must be True (the engine's exactness
  guarantee); with temperature > 0 the two sides draw differently and usually differ.
- verdict: the conclusion in words (`Verdict.text`), derived from the measured figures only, so
  that it cannot contradict them: decode_speedup = tokens per target forward / the time of a
  speculative round in plain steps (both sides' decode_s / target_forwards), an identity of the
  two sides' statistics; acceptance as Stats.acceptance; the drafter's cost per drafted token
  from the engine's measured costs; the machine's load average per core over the A/B.
- A stop (the `stop` event) before both first answers are in ends the A/B: the result has
  stopped=True, no speedup, no comparison (identical and first_difference are None: the answers
  were not both finished), and the speculative side may not have run (its `done` is False). A stop
  during the timing repeats ends them: the answers are compared, and the pairs timed so far judged.
"""

from __future__ import annotations

import os
import random
import statistics
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace

from engine.backend import Backend, BuiltIn, Request
from engine.engine import RequestError
from engine.draft_length import PassCosts
from engine.loop import Chunk, DecodeSettings, Done
from engine.sampling import SamplingSettings
from engine.stats import PAUSED, Stats

DIFFERENCE_TOKENS = 8  # how much of each side `Difference` shows from the first differing token
DIFFERENCE_CHARS = 32  # the same, when the sides are compared as text
BUSY = 1.0  # load average per core above which timings are called noisy
MIN_PAIRS = 2  # alternating pairs of answers timed at least (the first pair's answers are shown)
MAX_PAIRS = 4  # ...and at most (short answers: TIMING_S / a pair's seconds)
TIMING_S = 8.0  # the seconds of answering a short A/B's pairs add up to, about


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
    plain: Side  # the first pair's answers (the ones shown)
    speculative: Side
    pair: int = 1  # the pair being answered (1: the answers shown; then timing repeats)
    pairs: int = MIN_PAIRS  # the pairs planned (known once the first pair is timed)


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
    spread: tuple[float, float] | None = None  # the smallest and largest pair's speedup
    pairs: int = 0  # pairs of answers timed (alternating sides)
    measured: bool = False  # the spread excludes 1 over at least MIN_PAIRS pairs (module docstring)
    ceiling: float | None = None  # the speedup a perfect, free drafter could give (module docstring)
    impossible: bool = False  # the speedup is above `ceiling`: not a result

    def as_dict(self) -> dict:
        """Plain data (answers, statistics, comparison) for JSON."""
        sides = {side.mode: {"text": side.text, "stats": side.stats.as_dict() if side.stats else None}
                 for side in (self.plain, self.speculative)}
        first_difference = asdict(self.first_difference) if self.first_difference else None
        verdict = {**asdict(self.verdict), "text": self.verdict.text} if self.verdict else None
        return {**sides, "decode_speedup": self.decode_speedup, "time_ratio": self.time_ratio,
                "identical": self.identical, "first_difference": first_difference, "stopped": self.stopped,
                "verdict": verdict, "spread": self.spread, "pairs": self.pairs, "measured": self.measured,
                "ceiling": self.ceiling, "impossible": self.impossible}


def run_ab(backend: Backend, messages: list[dict], drafter: str | None = None,
           sampling: SamplingSettings = SamplingSettings(), decode: DecodeSettings = DecodeSettings(),
           stop: threading.Event | None = None, max_image_tokens: int | None = None,
           against: Backend | None = None) -> Iterator[ABProgress | ABResult]:
    """Answer the conversation's last user turn plainly and with `drafter` (default: the
    backend's default drafter), in alternating pairs (the module's "Equal terms"), each image at
    most `max_image_tokens` tokens (engine.prepare); an ABProgress after every chunk of the first
    pair and as each timing repeat starts, then one ABResult.

    `against`: another backend instead. The first side ("plain" in the result) is `backend` with
    `drafter` (None: as it decodes by default), the second ("speculative") is `against`, as it
    decodes by default (its default drafter: llama.cpp's draft model, none for a server that
    decides); the answers are compared as text unless both are the same backend."""
    if against is None:
        drafter = drafter or backend.capabilities.default_drafter
        if drafter is None:
            raise RequestError("A/B needs a drafter and none is loaded")
    runs = {"plain": (backend, None), "speculative": (backend, drafter)} if against is None else \
        {"plain": (backend, drafter), "speculative": (against, against.capabilities.default_drafter)}
    if sampling.seed is None:  # every run of a side draws as its first did
        sampling = replace(sampling, seed=random.getrandbits(63))
    shown = {"plain": Side("plain"), "speculative": Side("speculative")}
    progress, timed = ABProgress("plain", shown["plain"], shown["speculative"]), []
    load_before = os.getloadavg()[0]
    while progress.pair <= progress.pairs and not (stop is not None and stop.is_set()):
        order = AB_ORDER if progress.pair % 2 else AB_ORDER[::-1]  # ABBA: a steady drift weighs on both
        sides = shown if progress.pair == 1 else {mode: Side(mode) for mode in order}
        for mode in order:
            if stop is not None and stop.is_set():
                break
            progress.running = mode
            yield replace(progress)
            side_backend, side_drafter = runs[mode]
            for event in side_backend.stream(Request(messages, side_drafter, sampling, decode, stop,
                                                     max_image_tokens=max_image_tokens)):
                sides[mode].update(event)
                if progress.pair == 1:
                    yield replace(progress)
        if not all(_finished(side) for side in sides.values()):
            break
        timed.append((sides["plain"].stats, sides["speculative"].stats))
        progress.pairs = _pairs_wanted(shown) if progress.pair == 1 else progress.pairs
        progress.pair += 1
    load = (load_before + os.getloadavg()[0]) / 2 / (os.cpu_count() or 1)
    built_in = backend.engine if isinstance(backend, BuiltIn) and (against is None or against is backend) else None
    yield compare(built_in.target.tokenizer if built_in else None, shown["plain"], shown["speculative"],
                  sampling.temperature, load, _draft_cost(built_in, shown["speculative"].stats) if built_in else None,
                  verdict_of=against is None, pairs=timed,
                  ceiling=_ceiling(built_in.costs, shown["speculative"].stats) if built_in else None)


AB_ORDER = ("plain", "speculative")


def _finished(side: Side) -> bool:
    return side.done and side.stats is not None and side.stats.finish_reason != "stopped"


def _pairs_wanted(shown: dict[str, Side]) -> int:
    """Pairs to time, from the first pair: none more when a side's speed is not measured (too
    short to compare), else TIMING_S / the pair's seconds, from MIN_PAIRS to MAX_PAIRS."""
    if not all(side.stats.speed_measured for side in shown.values()):
        return 1
    pair_s = sum(side.stats.total_s for side in shown.values())
    return max(MIN_PAIRS, min(MAX_PAIRS, int(TIMING_S // max(pair_s, 1e-9))))


def compare(tokenizer, plain: Side, speculative: Side, temperature: float = 0.0, load_per_core: float | None = None,
            draft_cost: float | None = None, verdict_of: bool = True, pairs: list[tuple[Stats, Stats]] | None = None,
            ceiling: float | None = None) -> ABResult:
    """Speedup, identity and (`verdict_of`: plain against speculative decoding of one engine) the
    verdict of two finished sides (see the module's conventions); with no `tokenizer` the texts
    are compared, character by character. `pairs`: the (plain, speculative) statistics of every
    pair timed, the shown answers' first (default: those alone); `ceiling`: the speedup a
    perfect, free drafter could give (None: not known)."""
    stopped = not (plain.done and speculative.done) or "stopped" in (
        plain.stats.finish_reason, speculative.stats.finish_reason)
    if stopped:
        return ABResult(plain, speculative, None, None, identical=None, first_difference=None, stopped=True,
                        verdict=Verdict("Stopped before both sides finished: no speedup or comparison to report"))
    index, difference = _difference(tokenizer, plain, speculative)
    result = ABResult(plain, speculative, None, _ratio(plain.stats.total_s, speculative.stats.total_s),
                      identical=index is None, first_difference=difference, ceiling=ceiling)
    _judge_speed(result, [(plain.stats, speculative.stats)] if pairs is None else pairs, verdict_of)
    if verdict_of:
        result.verdict = verdict(result, temperature, load_per_core, draft_cost)
    return result


def _judge_speed(result: ABResult, pairs: list[tuple[Stats, Stats]], same_engine: bool) -> None:
    """decode_speedup, spread, pairs, measured and impossible (the module's conventions)."""
    ratios = [s.decode_tok_s / p.decode_tok_s for p, s in pairs if p.speed_measured and s.speed_measured]
    result.pairs = len(pairs)
    if not (result.plain.stats.speed_measured and result.speculative.stats.speed_measured and ratios):
        return
    result.decode_speedup, result.spread = statistics.median(ratios), (min(ratios), max(ratios))
    result.measured = len(ratios) >= MIN_PAIRS and (result.spread[0] > 1 or result.spread[1] < 1)
    spec = result.speculative.stats
    if same_engine and spec.accepted == 0 and "accepted" not in spec.unknown and result.spread[1] >= 1:
        result.measured = False  # nothing accepted: never faster (a higher speed is the machine's noise)
    result.impossible = result.measured and result.ceiling is not None and result.decode_speedup > result.ceiling
    result.measured = result.measured and not result.impossible  # (a spread over 1 already says: no difference)


def _difference(tokenizer, plain: Side, speculative: Side) -> tuple[int | None, Difference | None]:
    """Where the answers first differ (token ids; the texts when there is no `tokenizer`)."""
    if tokenizer is None:
        index = first_difference_index(plain.text, speculative.text)
        return index, None if index is None else Difference(
            index, index, plain.text[index:index + DIFFERENCE_CHARS],
            speculative.text[index:index + DIFFERENCE_CHARS])
    index = first_difference_index(plain.token_ids, speculative.token_ids)
    return index, None if index is None else Difference(
        index=index,
        char_index=len(tokenizer.decode(plain.token_ids[:index], skip_special_tokens=True)),
        plain=tokenizer.decode(plain.token_ids[index:index + DIFFERENCE_TOKENS], skip_special_tokens=True),
        speculative=tokenizer.decode(speculative.token_ids[index:index + DIFFERENCE_TOKENS],
                                     skip_special_tokens=True),
    )


def verdict(result: ABResult, temperature: float, load_per_core: float | None, draft_cost: float | None) -> Verdict:
    """The conclusion of a finished A/B, from its figures (see the module's conventions)."""
    plain, spec = result.plain.stats, result.speculative.stats
    found = Verdict("", load_per_core=load_per_core, draft_cost=draft_cost)
    speedup = result.decode_speedup
    passes_unknown = "target_forwards" in spec.unknown + plain.unknown  # e.g. llama.cpp: engine/backends/llamacpp.py
    if speedup is None or not passes_unknown and not (spec.target_forwards and plain.target_forwards):
        found.headline = "Too short to compare: an answer of one token has no decoding steps to time"
        return _identity(found, result, temperature)
    found.headline = _headline(result)
    accepted = "" if spec.acceptance is None else f" (acceptance {spec.acceptance:.0%}: {spec.accepted} of {spec.drafted} drafted tokens kept)"
    if passes_unknown:
        found.reasons.append(f"the backend does not report its target passes{accepted}, so the speedup is not "
                             "split into tokens per pass and the cost of a round")
        found.reasons += [spec.fallback_reason] if spec.fallback_reason else []
        return _busy_and_identity(found, result, temperature, load_per_core)
    found.round_cost = (spec.decode_s / spec.target_forwards) / (plain.decode_s / plain.target_forwards)
    tokens, shown = spec.tokens_per_forward, spec.decode_tok_s / plain.decode_tok_s
    found.reasons.append(f"in the answers shown each target pass yielded {tokens:.2f} tokens{accepted}, and each "
                         f"round took {found.round_cost:.2f}× a plain step: {tokens:.2f} / {found.round_cost:.2f} = "
                         f"{shown:.2f}×")
    if spec.drafting_paused or spec.drafted == 0:
        found.reasons.append(f"{PAUSED} by the end of the answer, so most steps were plain ones")
    elif draft_cost is not None:
        found.reasons.append(f"drafting one token cost {draft_cost:.2f} of a plain step")
    if result.measured and result.time_ratio is not None and (result.time_ratio >= 1) != (speedup >= 1):
        found.reasons.append(f"the whole answer, prefill and the drafter's own start included, was "
                             f"{result.time_ratio:.2f}× as fast")
    return _busy_and_identity(found, result, temperature, load_per_core)


def _headline(result: ABResult) -> str:
    """The verdict's first sentence: a speedup only where it is a result (the module's conventions)."""
    speedup, spec = result.decode_speedup, result.speculative.stats
    spread = (f"{result.spread[0]:.2f}× to {result.spread[1]:.2f}× over {result.pairs} alternating pairs"
              if result.pairs > 1 else "1 pair timed, so no spread to judge it by")
    if result.impossible:
        return (f"Not a result: {speedup:.2f}× is more than the {result.ceiling:.2f}× a drafter that is always "
                "right and free could give at the measured pass costs, so the timings were disturbed (the machine's "
                "load changed during the A/B)")
    if spec.accepted == 0 and "accepted" not in spec.unknown and not (result.measured and speedup < 1):
        return ("No measurable difference: no drafted token was accepted, so every token came from a target pass as "
                f"in plain decoding, and speculative decoding cannot have been faster ({spread})")
    if not result.measured:
        return f"No measurable difference between speculative and plain decoding: {speedup:.2f}× ({spread})"
    pace = "faster than" if speedup > 1 else "slower than"
    return f"Speculative decoding was {pace} plain decoding: {speedup:.2f}× the decode speed ({spread})"


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


def _ceiling(costs: PassCosts, stats: Stats | None) -> float | None:
    """The speedup a perfect, free drafter could give at the answer's draft lengths (the module's
    conventions): sum(k + 1) / sum(t(k + 1)), each pass priced from one plain step to k + 1 of them
    (a pass over k + 1 rows is never cheaper than one row, nor dearer than k + 1 passes of one: a
    noisy cost table cannot put the ceiling under 1), the loop's own work added to both; None for
    trees (their passes are priced apart) or while a size is unmeasured."""
    lengths = stats.draft_lengths if stats is not None and stats.draft_shape == "chain" else []
    plain = costs.verify.at(1)
    passes = [costs.verify.at(k + 1) for k in lengths]
    if not lengths or plain is None or None in passes:
        return None
    overhead = costs.overhead_cost()
    priced = [min(max(t, plain), (k + 1) * plain) + overhead for k, t in zip(lengths, passes)]
    return sum(k + 1 for k in lengths) * (plain + overhead) / sum(priced)


def first_difference_index(a: list[int] | str, b: list[int] | str) -> int | None:
    """The first index where the sequences differ (a prefix differs at the shorter's end)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None
