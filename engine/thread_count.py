"""How many threads the target's passes run on, chosen from their measured cost, as the draft length is.

A pass runs about a hundred OpenMP parallel regions (the smol demo: four products a layer, 30
layers, and the output layer), each split evenly between the threads and ended by a barrier. On a
machine where another process keeps a core busy (a browser drawing the answer, a build), the
scheduler takes one of two threads away for a time slice at a time, and every region waits for it
at its barrier: measured on 2 cores while another process spun one, `python -m engine --mode plain`
decoded 3.5-20 tok/s on 2 threads and 132-142 tok/s on 1 (190 on 2 threads with nothing else
running; docs/performance.md, "Threads from measured cost").

So the worker (engine/worker.py) times each round's passes by thread count and by the number of
rows they held, runs on the count whose passes of that size cost less, and now and then runs one
round with the other count (soon after a switch, then less and less often while it loses), so it
notices when the other process has gone; when it comes, the count in use costs more than the
other's last measure and the count changes at once. With one
thread to start with (OMP_NUM_THREADS=1, torch.set_num_threads(1)) it never tries more. The
count changes only the time a decode or verify pass takes, never its bits: the compiled products sum
each output in one fixed order whatever thread computes it (engine/fast_layer.cpp). A prompt's pass
(ATen's products, on the worker thread at whatever count the last round left) is not shown to be
independent of the count: not checked here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FIRST_TRY = 2  # the round that first runs the other count
EVERY = 16  # rounds from a try to the next, after a switch; doubled after each try the other count lost ...
MOST_EVERY = 1024  # ... up to this: a try on a busy machine can cost 30 rounds' time
WEIGHT = 0.3  # of a new measurement in a count's running cost


@dataclass
class ThreadCount:
    most: int  # the threads the process was given (torch.get_num_threads() on the thread that made the engine)
    costs: dict[tuple[int, int], float] = field(default_factory=dict)  # (threads, rows) -> running seconds a round
    rounds: int = 0
    current: int = 0  # the count in use; 0 until the first round: `most`
    next_try: int = FIRST_TRY  # the round that runs the other count
    every: int = EVERY

    def __post_init__(self):
        self.current = self.current or self.most

    def choose(self) -> int:
        """The count for the next round: the current one, or the other one when its try is due."""
        self.rounds += 1
        if self.most > 1 and self.rounds >= self.next_try:
            return self.other(self.current)
        return self.current

    def record(self, threads: int, rows: int, seconds: float) -> None:
        """A round's passes over `rows` rows took `seconds` on `threads` threads; the current count
        becomes the cheaper of the two where both have been measured at this size."""
        key = (threads, rows)
        old = self.costs.get(key)  # a try's count was last measured long ago: its try replaces that
        self.costs[key] = seconds if old is None or threads != self.current else old + WEIGHT * (seconds - old)
        if threads != self.current:  # a try: the next one sooner after a switch, later after each loss
            self.every = EVERY if self.cheaper(threads, rows) else min(2 * self.every, MOST_EVERY)
            self.next_try = self.rounds + self.every
        if self.cheaper(self.other(self.current), rows):
            self.current = self.other(self.current)

    def cheaper(self, threads: int, rows: int) -> bool:
        """Whether `threads` threads cost less than the other count, both measured at this size."""
        mine, theirs = self.costs.get((threads, rows)), self.costs.get((self.other(threads), rows))
        return mine is not None and theirs is not None and mine < theirs

    def other(self, threads: int) -> int:
        return 1 if threads == self.most else self.most


def use_threads(count: int) -> None:
    """Run the calling thread's next parallel regions on `count` threads (OpenMP's setting is the
    calling thread's own: the worker's, here)."""
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
