"""One thread owns the engine; callers queue requests and read their own event queues.

    for event in engine.worker.submit(messages, drafter="text", stop=stop):
        ...  # the same events as engine._run(messages, drafter="text", stop=stop)

`Engine.stream` is this. The worker thread takes requests in arrival order, up to the engine's
`running_requests` at once, and steps their answers (`Engine._steps`) together in rounds (continuous
batching): each round every running answer goes on to the target pass it needs next (drafting
with its own drafter session on the way), then those passes run as one shared target pass per
target (engine/tree.py `run_passes`: each answer's logits bitwise its own pass's), and each answer
accepts its own path in the next round. A new request joins at the next round; a finished,
stopped or abandoned one leaves at once, and its caches with it. Every event goes into that
request's own queue (as nanochat's chat_web.py worker and vLLM's per-request output queues do).
So a caller holds nothing while it reads: the time it spends between events is not decode time,
and a caller that walks away does not hold the engine:
- closing the stream, or dropping it unread, stops its request (a waiting one leaves the queue);
- setting the request's `stop` stops it; a request still waiting leaves the queue at once (its
  stream ends with the same stopped Done that `Engine._run` gives a request stopped before it
  started).
The thread starts with the first request and ends when nothing runs or waits, so an idle engine
holds no thread. Beyond `running_requests` a request waits in line (`queued`, `place`).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from engine import tree
from engine.loop import PassRequest
from engine.openmp_pool import release_thread_pool
from engine.thread_count import ThreadCount, use_threads

if TYPE_CHECKING:
    from engine.loop import Chunk, Done


class Runs(Protocol):
    """What the worker needs of the engine it serves (engine/engine.py `Engine`, which makes the
    worker: so the worker names no engine class, and no import runs back up)."""

    lock: threading.Lock  # one thread computing: held by the worker alone
    running_requests: int  # the most answers stepped together

    def _steps(self, messages, stop: threading.Event | None = None, **options) -> Generator: ...

    def stopped(self, drafter: str | None) -> Done: ...

STOP_POLL_S = 0.05  # how often a reader whose request waits in the queue looks at its stop flag
_END = object()  # the last item of a request's event queue


@dataclass(eq=False)
class Job:
    """One request: Engine._steps's arguments, its events, and how it can end early."""

    messages: object
    options: dict  # Engine._steps's keyword arguments, `stop` left out
    stop: threading.Event | None  # the caller's stop
    abandoned: threading.Event = field(default_factory=threading.Event)  # the caller closed or dropped the stream
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # Chunk, Done, an exception, then _END

    def is_set(self) -> bool:
        """Stopped, by the caller or by leaving: the `stop` that the engine reads."""
        return self.abandoned.is_set() or (self.stop is not None and self.stop.is_set())


@dataclass(eq=False)
class Running:
    """A running request: its answer's steps, and what goes back into them next."""

    job: Job
    steps: Generator  # Engine._steps: events and PassRequests
    reply: object = None  # the logits of its last pass, or the exception that pass raised; None: nothing

    def advance(self) -> PassRequest | None:
        """Go on to the answer's next target pass (returned), each event on the way into the job's
        queue; None when the answer ended (its queue closed)."""
        ended = None
        reply, self.reply = self.reply, None
        try:
            if isinstance(reply, Exception):
                item = self.steps.throw(reply)
            else:
                item = self.steps.send(reply)
            while not isinstance(item, PassRequest):
                self.job.events.put(item)
                item = next(self.steps)
            return item
        except StopIteration:
            pass
        except Exception as error:  # the reader raises it
            ended = error
        # The answer's tensors go before its reader hears the end: one freed on this thread while the
        # reader's process exits aborts it ("terminate called without an active exception").
        reply = self.steps = None
        if ended is not None:
            self.job.events.put(ended)
        self.job.events.put(_END)
        return None


class Worker:
    def __init__(self, engine: Runs):
        self.engine = engine
        self.lock = threading.Lock()  # guards `waiting`, `running` and `serving`
        self.waiting: deque[Job] = deque()
        self.running = 0  # requests being answered
        self.serving = False  # a thread is serving the queue
        self.threads = ThreadCount(torch.get_num_threads())  # the passes' threads, from their measured costs

    def submit(self, messages, stop: threading.Event | None = None, **options) -> Stream:
        """Queue a request (Engine._steps's arguments); its events, in order, as they come."""
        job = Job(messages, options, stop)
        release_thread_pool()  # the caller's idle OpenMP pool would slow the worker's every region (engine/openmp_pool.py)
        with self.lock:
            self.waiting.append(job)
            if not self.serving:
                self.serving = True
                threading.Thread(target=self._serve, name="engine-worker", daemon=True).start()
        return Stream(self, job)

    def queued(self) -> int:
        """Requests waiting in line behind the running ones."""
        with self.lock:
            return len(self.waiting)

    def place(self, job: Job) -> int:
        """The job's place in line: 0 once it runs (or ended), 1 for the next to start, ..."""
        with self.lock:
            return self.waiting.index(job) + 1 if job in self.waiting else 0

    def _serve(self) -> None:
        running: list[Running] = []
        while True:
            with self.engine.lock:  # the worker alone holds it: one thread computing
                with self.lock:  # those waiting join, in order, up to running_requests
                    while self.waiting and len(running) < self.engine.running_requests:
                        job = self.waiting.popleft()
                        running.append(Running(job, self.engine._steps(job.messages, stop=job, **job.options)))
                    self.running = len(running)
                    if not running:
                        self.serving = False
                        return
                running = self._round(running)

    def _round(self, running: list[Running]) -> list[Running]:
        """Every running answer on to its next target pass, then those passes, one shared pass per
        target; returns the answers still running (their passes' logits to go back in)."""
        asked = [(request, item) for request in running if (item := request.advance()) is not None]
        by_target: dict[int, list[tuple[Running, PassRequest]]] = {}
        for request, item in asked:
            item.beside = len(asked) - 1
            by_target.setdefault(id(item.target), []).append((request, item))
        for group in by_target.values():
            passes = [item.one for _, item in group]
            threads = self.threads.choose()  # from the passes' measured costs (engine/thread_count.py)
            use_threads(threads)
            started = time.perf_counter()
            try:
                replies = tree.run_passes(group[0][1].target, passes)
                self.threads.record(threads, sum(len(one.token_ids) for one in passes), time.perf_counter() - started)
            except Exception as error:  # thrown into each answer of the pass (the engine words it)
                replies = [error] * len(group)
            for (request, _), reply in zip(group, replies):
                request.reply = reply
        return [request for request, _ in asked]

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
        self.job = job  # for its place in line (Worker.place)
        self._events = worker.events(job)
        self._abandon = weakref.finalize(self, abandon, worker, job)  # also when dropped unread

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk | Done:
        return next(self._events)

    def close(self) -> None:
        self._events.close()
        self._abandon()
