"""Answers decoded together (engine/worker.py's rounds, their target passes shared) against the same
answers one after another, in this engine: aggregate decode tok/s both ways, each answer's tok/s and
time to first token together (p50 / p95), and whether every answer together equals itself alone
(greedy). Not the app's visitors (that is a load test through the server): the engine's worker alone.

    python -m measure.together [--preset smol] [--requests 8] [--plain] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from engine.loop import DecodeSettings, Done
from measure.bench import demo_requests, photo_requests, request_messages, smol_requests


def answers(engine, conversations: list, drafter, decode: DecodeSettings, together: bool) -> tuple[list[Done], float]:
    """Every conversation's Done and the seconds from the first request to the last answer: submitted
    while the worker cannot start a round (together: they start in one), or each after the last."""
    started = time.perf_counter()
    if not together:
        return [list(engine.stream(c, drafter, decode=decode))[-1] for c in conversations], time.perf_counter() - started
    with engine.lock:
        streams = [engine.stream(c, drafter, decode=decode, started=started) for c in conversations]
    return [list(stream)[-1] for stream in streams], time.perf_counter() - started


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def main(argv=None) -> int:
    from engine.build import add_model_flags, build_engine, spec_from_args

    parser = argparse.ArgumentParser(prog="python -m measure.together", description=__doc__.split("\n\n")[0])
    add_model_flags(parser)
    parser.add_argument("--requests", type=int, default=8, help="answers decoded together (default 8)")
    parser.add_argument("--plain", action="store_true", help="decode plainly (default: the first drafter, k from cost)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="each answer's most tokens (default 128)")
    args = parser.parse_args(argv)
    spec = spec_from_args(args)
    engine = build_engine(spec)
    engine.running_requests = max(engine.running_requests, args.requests)
    source = {"demo": demo_requests, "smol": smol_requests}.get(spec.preset, photo_requests)
    conversations = [request_messages(request) for request in source(args.requests)]
    drafter = None if args.plain else next(iter(engine.drafters), None)
    decode = DecodeSettings(max_new_tokens=args.max_new_tokens, stop_token_ids=frozenset({-1}))
    answers(engine, conversations[:1], drafter, decode, together=False)  # warm-up
    alone, alone_s = answers(engine, conversations, drafter, decode, together=False)
    shared, shared_s = answers(engine, conversations, drafter, decode, together=True)
    tokens = sum(len(done.token_ids) for done in shared)
    ttft = [done.stats.ttft_s for done in shared]
    each = [done.stats.decode_tok_s for done in shared]
    print(f"| answers | drafter | one after another | together | x | each together (min-max) | TTFT p50 / p95 "
          f"| equal to alone |\n|---|---|---|---|---|---|---|---|\n| {len(conversations)} | {drafter or 'none'} "
          f"| {sum(len(d.token_ids) for d in alone) / alone_s:.1f} tok/s | {tokens / shared_s:.1f} tok/s "
          f"| {alone_s / shared_s:.2f} | {min(each):.1f}-{max(each):.1f} tok/s "
          f"| {statistics.median(ttft):.2f} / {percentile(ttft, 0.95):.2f} s "
          f"| {sum(a.token_ids == b.token_ids for a, b in zip(alone, shared))}/{len(shared)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
