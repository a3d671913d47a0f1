"""Where one plain token's time goes, end to end, as the app and the benchmark run it.

    python -m measure.profile_token [--requests 6] [--rounds 3] [--max-new-tokens 128]

Loads the bundled demo target (as `measure.bench` does, without drafters) and answers the
benchmark's requests plainly (greedy) in three ways, interleaved request by request, each on a
thread of its own as the engine's worker runs them:
- `stream`: `Engine.stream`, as the app and the benchmark call it: the worker thread hands every
  event to the caller's thread through a queue;
- `kept`: the same `Engine._run` under the engine's lock, as the worker runs it, on a thread whose events stay there (the caller waits on the
  thread's end): no hand-off per event. stream / kept is the hand-off's cost;
- `split`: `kept` with a timer around each stage's function (a stage's time excludes the
  stages called inside it): the forward (FastDecoder.forward: its Python and operators), the runner around
  it, accepting (the argmax and its host sync), detokenizing, snapshots of the statistics, the
  statistics, the draft length and pass costs, the (empty) drafter calls; the rest of the
  loop is what is left of the time per token. Once more with cProfile (Python calls per token)
  and a torch function mode (torch calls from Python per token, by stage), and once with
  torch.profiler (aten operator calls per token).
tok/s figures come from runs without timers or profilers (they slow what they measure).

`Timers.installed` wraps the STAGES' functions on their classes and modules for the length of one
answer and puts them back in `finally`: the one place in the project that replaces engine code at
run time. It stays so on purpose: the split must time the engine's own objects as the app builds
them, and the alternatives cost more than they show (a timing hook as a parameter of the loop,
the runner and the detokenizer, for a tool; or `sys.setprofile`, whose hook runs on every Python call,
where these wrappers run on the thirteen STAGES). Nothing else imports this module.
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import pstats
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import replace

import torch
from torch.overrides import TorchFunctionMode

from engine import fast_decode, loop, runner, stats, tree
from engine.build import add_model_flags, build_engine, spec_from_args
from engine.draft_length import DraftLength
from engine.drafters.base import GuardedSession
from engine.loop import DecodeSettings, Done
from engine.openmp_pool import release_thread_pool
from measure.bench import demo_requests, request_messages

STAGES = [  # (owner, function, stage)
    (fast_decode.FastDecoder, "forward", "forward: its Python and operators"),
    (runner.Runner, "extend", "runner around the forward"),
    (tree, "verify", "runner around the forward"),
    (tree, "keep", "runner around the forward"),
    (loop, "accept_tree", "accept: argmax, host sync"),
    (loop.TextStream, "push", "detokenize"),
    (stats.Stats, "snapshot", "statistics snapshot"),
    (stats.Stats, "record_round", "statistics"),
    (stats.Stats, "record_time", "statistics"),
    (stats.Stats, "record_draft_length", "statistics"),
    (DraftLength, "update", "draft length, pass costs"),
    (GuardedSession, "propose", "drafter calls (empty)"),
    (GuardedSession, "accept", "drafter calls (empty)"),
]


class Timers:
    """Exclusive wall time and torch calls by stage, of the functions in STAGES while installed."""

    def __init__(self):
        self.seconds, self.torch_calls, self.stack = Counter(), Counter(), []  # stack: [stage, child seconds]

    @contextlib.contextmanager
    def installed(self):
        originals = [(owner, name, getattr(owner, name)) for owner, name, _ in STAGES]
        for (owner, name, original), (_, _, stage) in zip(originals, STAGES):
            setattr(owner, name, self._timed(original, stage))
        try:
            yield self
        finally:
            for owner, name, original in originals:
                setattr(owner, name, original)

    def _timed(self, function, stage: str):
        def timed(*args, **kwargs):
            self.stack.append([stage, 0.0])
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                self.seconds[stage] += elapsed - self.stack.pop()[1]
                if self.stack:
                    self.stack[-1][1] += elapsed
        return timed

    def stage(self) -> str:
        return self.stack[-1][0] if self.stack else "loop, engine, rest"


class CountTorchCalls(TorchFunctionMode):
    """Counts torch functions and tensor methods called from Python (attribute reads left out)."""

    def __init__(self, timers: Timers):
        super().__init__()
        self.timers = timers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") != "__get__":
            self.timers.torch_calls[self.timers.stage()] += 1
        return func(*args, **(kwargs or {}))


def on_thread(work):
    """work() on a new thread, as the worker runs a request (the caller's OpenMP pool given back first)."""
    result = []
    release_thread_pool()
    thread = threading.Thread(target=lambda: result.append(work()))
    thread.start()
    thread.join()
    return result[0]


def answer(engine, messages, decode: DecodeSettings, way: str, timers: Timers | None = None):
    """The Done of one plain answer, run the given way ("stream", "kept", "split"); "python" and
    "torch" also return a cProfile.Profile and torch.profiler's averages; "torch calls" counts
    into `timers`."""
    if way == "stream":
        return [e for e in engine.stream(messages, decode=decode) if isinstance(e, Done)][0]

    def run():  # as the worker runs a request (engine/worker.py), on this thread
        with engine.lock:
            return [e for e in engine._run(messages, decode=decode)][-1]

    def measured():  # on the answer's own thread: profilers and function modes are per thread
        if way == "python":
            profiler = cProfile.Profile()
            done = profiler.runcall(run)
            return done, profiler
        if way == "torch":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                done = run()
            return done, prof.key_averages()
        with timers.installed() if way in ("split", "torch calls") else contextlib.nullcontext():
            with CountTorchCalls(timers) if way == "torch calls" else contextlib.nullcontext():
                return run()

    return on_thread(measured)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.profile_token", description=__doc__.split("\n\n")[0])
    add_model_flags(parser)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3, help="passes over the requests (the first also warms up)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    engine = build_engine(replace(spec_from_args(args), drafters=()))
    decode = DecodeSettings(max_new_tokens=args.max_new_tokens)
    requests = [request_messages(r) for r in demo_requests(args.requests)]
    for messages in requests[:2]:  # warm-up
        answer(engine, messages, decode, "kept")

    tok_s, timers, split_tokens, split_s = {"stream": [], "kept": []}, Timers(), 0, 0.0
    for round_index in range(args.rounds):
        for index, messages in enumerate(requests):
            ways = ["stream", "kept", "split"] if (round_index + index) % 2 else ["split", "kept", "stream"]
            for way in ways:
                done = answer(engine, messages, decode, way, timers)
                if way == "split":
                    split_tokens, split_s = split_tokens + done.stats.decode_tokens, split_s + done.stats.decode_s
                else:
                    tok_s[way].append(done.stats.decode_tok_s)
    pairs = [s / k for s, k in zip(tok_s["stream"], tok_s["kept"])]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(pairs)} answers each way")
    print(f"decode tok/s, median: stream {statistics.median(tok_s['stream']):.0f}, kept on the worker "
          f"{statistics.median(tok_s['kept']):.0f}; stream / kept per answer: median {statistics.median(pairs):.3f} "
          f"(min {min(pairs):.3f}, max {max(pairs):.3f})")

    per_token_us = 1e6 * split_s / split_tokens
    staged = {stage: 1e6 * s / split_tokens for stage, s in timers.seconds.items()}
    staged["loop, engine, rest"] = per_token_us - sum(staged.values())
    # Counts per decoded token: an answer less the same request cut at its first token (prefill).
    one = replace(decode, max_new_tokens=1)
    counted, prefill_counted = Timers(), Timers()
    done = answer(engine, requests[0], decode, "torch calls", counted)
    answer(engine, requests[0], one, "torch calls", prefill_counted)
    tokens = done.stats.decode_tokens
    torch_calls = {stage: (calls - prefill_counted.torch_calls[stage]) / tokens
                   for stage, calls in counted.torch_calls.items()}
    print(f"\nsplit of one decoded token ({split_tokens} tokens timed, {per_token_us:.0f} us/token with timers):")
    print(f"    {'stage':<34} {'us/token':>9} {'share':>6} {'torch calls/token':>18}")
    for stage, us in sorted(staged.items(), key=lambda item: -item[1]):
        print(f"    {stage:<34} {us:9.1f} {us / per_token_us:6.1%} {torch_calls.get(stage, 0.0):18.1f}")
    (_, profiler), (_, prefill_profiler) = (answer(engine, requests[0], d, "python") for d in (decode, one))
    functions = pstats.Stats(profiler)
    (_, averages), (_, prefill_averages) = (answer(engine, requests[0], d, "torch") for d in (decode, one))
    aten_calls = sum(e.count for e in averages if e.key.startswith("aten::")) - sum(
        e.count for e in prefill_averages if e.key.startswith("aten::"))
    print(f"Python function calls per token (cProfile): "
          f"{(functions.total_calls - pstats.Stats(prefill_profiler).total_calls) / tokens:.0f}; "
          f"aten operator calls per token (torch.profiler, nested ones included): {aten_calls / tokens:.0f}")
    print("top Python functions by own time (cProfile, one answer, its prefill included):")
    functions.sort_stats("tottime").print_stats(20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
