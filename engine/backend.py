"""The interface a backend implements: what answers the app's requests.

    backend = BuiltIn(engine)                     # or OpenAIServer(url) (engine/backends/openai.py)
    for event in backend.stream(Request(messages, drafter="text", stop=stop)):
        ...  # Chunk events, then one Done (engine/loop.py), each with a snapshot of Stats

A backend has two members:
- `capabilities`: what it can do and report (below). The app shows only what a backend reports;
  a statistic it cannot measure is listed in `Stats.unknown` (None in `Stats.as_dict()`), never
  filled with a guess.
- `stream(request)`: the request's events, in order: Chunks (the new text; `token_ids` and
  `origins` where the backend knows them, else empty), then one Done (the whole answer, final
  statistics). Stopping: the caller sets `request.stop` (any thread), or closes the stream, or
  drops it; either way the request ends and the backend holds nothing for it. A stream must not
  hold a lock between events: a caller that walks away never blocks the next request. Bad input
  or a failing server raises RequestError (engine/engine.py) with a one-line message.

Messages are engine/prompt.py's format: [{"role", "content": [{"type": "text", "text"} |
{"type": "image", "image": PIL.Image}]}]. Adding a backend: docs/backends.md.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Protocol

from engine.engine import AUTO, Engine
from engine.loop import Chunk, DecodeSettings, Done
from engine.prompt import Prompt
from engine.sampling import SamplingSettings
from engine.stats import Stats

ALL_STATISTICS = frozenset(f.name for f in fields(Stats))


@dataclass(frozen=True)
class Request:
    messages: list[dict] | Prompt  # a Prompt (Engine.prepare) only for the built-in engine
    drafter: str | None = None  # one of capabilities.drafters; None: plain decoding
    sampling: SamplingSettings = SamplingSettings()
    decode: DecodeSettings = DecodeSettings()
    stop: threading.Event | None = None
    started: float | None = None  # the request's start (time.perf_counter()); times count from it
    max_image_tokens: int | None = None  # a budget per image, where the backend can apply one


@dataclass(frozen=True)
class Capabilities:
    name: str  # shown beside the statistics: "built-in", "llama.cpp", "http://host:8080"...
    images: bool = False  # messages may carry images
    speculative: bool = False  # it can decode speculatively
    draft_origins: bool = False  # Chunk.origins says which tokens were accepted drafts
    token_ids: bool = False  # Chunk.token_ids and Done.token_ids are the model's ids
    drafters: tuple[str, ...] = ()  # the names Request.drafter may take
    drafter_kinds: tuple[str, ...] = ()  # what each of them is, where known ("text_lm": app_ui/views.py DRAFTER_LABELS)
    default_drafter: str | None = None
    statistics: frozenset[str] = ALL_STATISTICS  # the Stats fields it measures; the others are unknown

    def unknown(self) -> tuple[str, ...]:
        """The Stats fields this backend cannot measure, for `Stats.unknown`."""
        return tuple(name for name in (f.name for f in fields(Stats)) if name not in self.statistics | {"unknown"})


class Backend(Protocol):
    capabilities: Capabilities

    def stream(self, request: Request) -> Iterator[Chunk | Done]:
        ...


@dataclass
class BuiltIn:
    """The project's own engine, served one request at a time by its worker thread."""

    engine: Engine
    capabilities: Capabilities = field(init=False)

    def __post_init__(self):
        drafters = tuple(self.engine.drafters) + ((AUTO,) if self.engine.drafters else ())
        self.capabilities = Capabilities("built-in", images=True, speculative=bool(self.engine.drafters),
                                         draft_origins=True, token_ids=True, drafters=drafters,
                                         default_drafter=self.engine.default_drafter)

    def stream(self, request: Request) -> Iterator[Chunk | Done]:
        return self.engine.worker.submit(request.messages, drafter=request.drafter, sampling=request.sampling,
                                         decode=request.decode, stop=request.stop, started=request.started,
                                         max_image_tokens=request.max_image_tokens)


def stream_timed(stats: Stats, started: float, first_at: float, now: float) -> None:
    """A streamed answer's times, for a backend that sees only its stream: time to first token
    from the request's start, decode speed over the tokens after the first (`stats.new_tokens`)."""
    stats.ttft_s = first_at - started
    stats.decode_tokens = stats.new_tokens - 1
    stats.decode_s = now - first_at
    stats.decode_tok_s = stats.decode_tokens / stats.decode_s if stats.decode_s > 0 else 0.0
    stats.total_s = now - started
    stats.tok_s_curve.append(round(stats.decode_tok_s, 2))
