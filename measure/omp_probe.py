"""How long one small product takes on the main thread and on another thread, with the main
thread's OpenMP pool kept or given back (engine/openmp_pool.py):

    python -m measure.omp_probe

Each figure: microseconds per 192 -> 576 one-row product (the demo model's width), best of 5 x 2000.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.nn.functional as F

from engine.openmp_pool import release_thread_pool


def per_product_us(x: torch.Tensor, weight: torch.Tensor) -> float:
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(2000):
            F.linear(x, weight)
        best = min(best, (time.perf_counter() - started) / 2000 * 1e6)
    return best


def on_a_thread(x: torch.Tensor, weight: torch.Tensor) -> float:
    out = []
    thread = threading.Thread(target=lambda: out.append(per_product_us(x, weight)))
    thread.start()
    thread.join()
    return out[0]


def main() -> int:
    x, weight = torch.randn(1, 192), torch.randn(576, 192)
    print(f"torch threads: {torch.get_num_threads()}")
    print(f"main thread: {per_product_us(x, weight):.1f} us")
    print(f"another thread, the main thread's pool kept: {on_a_thread(x, weight):.1f} us")
    per_product_us(x, weight)  # the main thread's pool, busy again
    print(f"given back: {release_thread_pool()}")
    print(f"another thread, the main thread's pool given back: {on_a_thread(x, weight):.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
