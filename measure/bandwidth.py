"""The machine's streaming-read bandwidth: the bound of plain decoding (every weight read once a token).

    python -m measure.bandwidth [--threads 1,2] [--mb 1024]

A float32 tensor far beyond the caches summed by torch (vectorized loads, one pass, split across
the threads), median of repeats: the bytes a second the cores can stream from memory. A decode
step that reads W bytes of weights cannot beat bandwidth / W tokens a second. A measurement, not
a test; on a busy machine it moves with the load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def streaming_read(threads: int, megabytes: int = 1024, repeats: int = 7) -> float:
    """GB/s of summing a `megabytes` float32 tensor on `threads` threads (median of repeats, the first
    left out: it pages the tensor in)."""
    data = torch.ones(megabytes * 2 ** 20 // 4)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            data.sum()
            times.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous)
    return data.numel() * 4 / statistics.median(times[1:]) / 1e9


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.bandwidth", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--mb", type=int, default=1024)
    args = parser.parse_args(argv)
    for threads in map(int, args.threads.split(",")):
        print(f"streaming read, {threads} thread{'s' if threads > 1 else ''}: "
              f"{streaming_read(threads, args.mb):.1f} GB/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
