"""One thread owns the engine; callers queue requests and read their own event queues.

    for event in engine.worker.submit(messages, drafter="text", stop=stop):
        ...  # the same events as engine._run(messages, drafter="text", stop=stop)

`Engine.stream` is this. The worker thread takes requests in arrival order and runs `Engine._run`
for each, putting every event into that request's own queue (as nanochat's chat_web.py worker
and vLLM's per-request output queues do). So a caller holds nothing while it reads: the time it spends
between events is not decode time, and a caller that walks away does not hold the engine:
- closing the stream, or dropping it unread, stops its request (a waiting one leaves the queue);
- setting the request's `stop` stops it; a request still waiting leaves the queue at once (its
  stream ends with the same stopped Done that `Engine._run` gives a request stopped before it
  started).
The thread starts with the first request and ends when the queue is empty, so an idle engine
holds no thread.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from engine.openmp_pool import release_thread_pool

if TYPE_CHECKING:
    from engine.loop import Chunk, Done


class Runs(Protocol):
    """What the worker needs of the engine it serves (engine/engine.py `Engine`, which makes the
    worker: so the worker names no engine class, and no import runs back up)."""

    lock: threading.Lock  # one generation at a time, held by the worker alone

    def _run(self, messages, stop: threading.Event | None = None, **options) -> Iterator[Chunk | Done]: ...

    def stopped(self, drafter: str | None) -> Done: ...

STOP_POLL_S = 0.05  # how often a reader whose request waits in the queue looks at its stop flag
_END = object()  # the last item of a request's event queue


@dataclass(eq=False)
class Job:
    """One request: Engine._run's arguments, its events, and how it can end early."""

    messages: object
    options: dict  # Engine._run's keyword arguments, `stop` left out
    stop: threading.Event | None  # the caller's stop
    abandoned: threading.Event = field(default_factory=threading.Event)  # the caller closed or dropped the stream
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # Chunk, Done, an exception, then _END

    def is_set(self) -> bool:
        """Stopped, by the caller or by leaving: the `stop` that the engine reads."""
        return self.abandoned.is_set() or (self.stop is not None and self.stop.is_set())


class Worker:
    def __init__(self, engine: Runs):
        self.engine = engine
        self.lock = threading.Lock()  # guards `waiting` and `serving`
        self.waiting: deque[Job] = deque()
        self.serving = False  # a thread is serving the queue

    def submit(self, messages, stop: threading.Event | None = None, **options) -> Stream:
        """Queue a request (Engine._run's arguments); its events, in order, as they come."""
        job = Job(messages, options, stop)
        release_thread_pool()  # the caller's idle OpenMP pool would slow the worker's every region (engine/openmp_pool.py)
        with self.lock:
            self.waiting.append(job)
            if not self.serving:
                self.serving = True
                threading.Thread(target=self._serve, name="engine-worker", daemon=True).start()
        return Stream(self, job)

    def queued(self) -> int:
        """Requests waiting behind the one being answered."""
        with self.lock:
            return len(self.waiting)

    def _serve(self) -> None:
        while True:
            with self.lock:
                if not self.waiting:
                    self.serving = False
                    return
                job = self.waiting.popleft()
            try:
                with self.engine.lock:  # the worker alone holds it: one answer at a time
                    for event in self.engine._run(job.messages, stop=job, **job.options):
                        job.events.put(event)
            except Exception as error:  # the reader raises it
                job.events.put(error)
            finally:
                job.events.put(_END)

    def withdraw(self, job: Job) -> bool:
        """Take `job` out of the queue; False when it is no longer waiting (running or done)."""
        with self.lock:
            if job in self.waiting:
                self.waiting.remove(job)
                return True
            return False

    def events(self, job: Job) -> Iterator[Chunk | Done]:
        try:
            while True:
                try:
                    item = job.events.get(timeout=STOP_POLL_S)
                except queue.Empty:
                    if job.is_set() and self.withdraw(job):
                        yield self.engine.stopped(job.options.get("drafter"))
                        return
                    continue
                if item is _END:
                    return
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            abandon(self, job)


def abandon(worker: Worker, job: Job) -> None:
    """The caller is gone: stop the request, or take it out of the queue."""
    job.abandoned.set()
    worker.withdraw(job)


class Stream:
    """A request's events. Closing it, or dropping it before the end, stops the request."""

    def __init__(self, worker: Worker, job: Job):
        self._events = worker.events(job)
        self._abandon = weakref.finalize(self, abandon, worker, job)  # also when dropped unread

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk | Done:
        return next(self._events)

    def close(self) -> None:
        self._events.close()
        self._abandon()
