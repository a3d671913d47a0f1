"""The line of answers waiting for the engine, as a waiting visitor's panel shows it: their place
in it and an estimate of the wait from the answers measured on this server.

Gradio queues the events of the concurrency group that generates (callbacks.GENERATE: one at a
time); `place` reads that queue through app_ui/queue_rules.py, the one module that reads Gradio's
queue for who waits. `AnswerTimes` keeps how long each recent answer held the engine (any
visitor's: the line is everyone's), so the estimate is the measured median times the answers ahead.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass, field

from app_ui import queue_rules

RECENT_ANSWERS = 20  # the answers the estimate is measured over


@dataclass
class AnswerTimes:
    """Seconds each of the server's latest answers held the engine (an A/B's whole run counts as one)."""

    seconds: deque = field(default_factory=lambda: deque(maxlen=RECENT_ANSWERS))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, seconds: float) -> None:
        with self.lock:
            self.seconds.append(seconds)

    def typical(self) -> tuple[float, int] | None:
        """(the median seconds, over how many answers), None before any answer was measured."""
        with self.lock:
            return (statistics.median(self.seconds), len(self.seconds)) if self.seconds else None


@dataclass(frozen=True)
class Place:
    ahead: int  # answers before this one: running, then waiting ahead of it
    estimate_s: float | None  # ahead x the typical answer's seconds; None before any was measured
    measured_over: int  # the answers that typical time is the median of


def place(blocks, group: str, session_hash: str | None, times: AnswerTimes) -> Place | None:
    """Where `session_hash`'s answer waits in `group`'s line; None when it does not wait there
    (it runs, it was stopped, or no Gradio queue serves the request)."""
    if blocks is None or not session_hash:
        return None
    waiting = queue_rules._waiting(blocks, group)
    index = next((i for i, event in enumerate(waiting) if event.session_hash == session_hash), None)
    if index is None:
        return None
    ahead = index + len(queue_rules._running(blocks, group))
    typical = times.typical()
    return Place(ahead, None if typical is None else ahead * typical[0], typical[1] if typical else 0)
