"""The calling thread's OpenMP thread pool, given back before another thread computes.

PyTorch's CPU kernels run their parallel regions on OpenMP (libgomp in the PyPI wheels), and
each thread that starts a parallel region gets a pool of its own. Once the pools hold more
threads than there are CPUs, libgomp stops spin-waiting between regions (its "throttled" spin
count), so every region of every pool wakes a sleeping thread. On the project's 2-core machine,
after the main thread had computed, a 192 -> 576 one-row product on another thread took 49-75 us
against 8-10 us (a one-off probe, `measure/omp_probe.py`, removed on 7 December: in git at
961223e), and the demo model decoded 3x slower on the engine's worker thread (engine/worker.py)
than on the main thread (docs/performance.md).
The main thread's pool is idle by then (it loaded the model), so it gives it back
(`omp_pause_resource_all`, OpenMP 5.0); the next parallel region on that thread makes a new one.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free the resources (threads) entirely


def release_thread_pool() -> bool:
    """Give back the calling thread's OpenMP pool; False where the OpenMP runtime cannot say."""
    runtime = _openmp()
    return runtime is not None and runtime.omp_pause_resource_all(OMP_PAUSE_HARD) == 0


@functools.cache
def _openmp():
    """The OpenMP runtime torch runs on (its bundled libgomp, or the system's); None if none."""
    import torch

    for name in glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*")) + [
            "libgomp.so.1", "libiomp5.so"]:
        try:
            runtime = ctypes.CDLL(name)
            runtime.omp_pause_resource_all.argtypes = [ctypes.c_int]
            return runtime
        except (OSError, AttributeError):
            continue
    return None
