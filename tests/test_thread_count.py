"""Threads for the target's passes from their measured cost (engine/thread_count.py): the worker runs
on the count whose passes cost less, tries the other one soon after a switch and less and less often
while it loses, and follows a busy machine both ways. Fed measured-looking seconds, not timed."""

from __future__ import annotations

import threading

import torch

from engine.thread_count import FIRST_TRY, MOST_EVERY, ThreadCount, use_threads


def run(count: ThreadCount, rounds: int, cost: dict[int, float], rows: int = 1) -> list[int]:
    """`rounds` rounds whose passes cost `cost[threads]` seconds; the counts they ran on."""
    used = []
    for _ in range(rounds):
        threads = count.choose()
        count.record(threads, rows, cost[threads])
        used.append(threads)
    return used


def test_another_process_on_a_core_moves_the_passes_to_one_thread_and_back():
    count = ThreadCount(most=2)
    quiet, busy = {2: 0.005, 1: 0.007}, {2: 0.115, 1: 0.008}
    used = run(count, 200, quiet)
    assert used[FIRST_TRY - 1] == 1 and count.current == 2  # tried once early, lost
    assert used.count(1) <= 5  # tries grow apart while one thread loses: 2, 18, 50, 114
    used = run(count, 3, busy)
    assert count.current == 1  # the count in use now costs more than the other's last measure
    used = run(count, 2000, busy)
    assert used.count(2) <= 8 and count.every == MOST_EVERY  # two threads tried ever less often
    used = run(count, MOST_EVERY + 1, quiet)
    assert count.current == 2 and count.every < MOST_EVERY  # the other process gone: two threads, tries anew


def test_sizes_are_compared_with_their_own_size():
    """A 5-row pass on two threads is not compared with a 1-row pass on one."""
    count = ThreadCount(most=2)
    count.record(2, 5, 0.011)
    count.record(1, 1, 0.007)
    assert count.current == 2


def test_one_thread_given_is_never_more():
    count = ThreadCount(most=1)
    assert set(run(count, 100, {1: 0.01})) == {1}


def test_the_count_is_the_calling_threads_own():
    """OpenMP's thread count is per thread: the worker's change leaves the caller's alone."""
    before = torch.get_num_threads()
    seen = []

    def worker():
        use_threads(1)
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [1] and torch.get_num_threads() == before
