"""One draft round of the drafter heads: the fast path against the module's forward, in one
process, interleaved.

    python -m measure.profile_drafts [--rounds 15] [--steps 20] [--k 4]

Loads the bundled demo target with its MTP head and block drafter (as `measure.bench` does),
prefills one benchmark request, and begins two sessions of each drafter on that target state:
its module's forward over a DynamicCache (`module_twin`) and the fast path (engine/fast_heads.py).
A timed step is one steady-state round after a rejected draft: one committed token's target row
joins (`accept(0)`), then `propose(k)`: the MTP head runs one context entry and k - 1 draft
entries (each with the target's embedding and output head), the block drafter one pass over
one context row and its block. `rounds` rounds of `steps` steps each, module then fast; prints
each path's median and best ms per step and the median of the per-round ratios (module / fast).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from engine.drafters.block import ModuleBlock
from engine.drafters.dflash import DFlashDrafter
from engine.drafters.mtp_head import MtpHeadDrafter
from engine.drafters.registry import load_drafter
from engine.engine import Engine
from engine.sampling import Sampler, SamplingSettings
from engine.target import load_target
from measure.bench import demo_requests, request_messages

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "demo")


def module_twin(drafter):
    """The same MTP head / block drafter (same module, same weights) with its module's own forward
    and a DynamicCache."""
    if drafter.kind == "mtp":
        return MtpHeadDrafter(drafter.name, drafter.module, drafter.head, drafter.family, fast=False)
    block = ModuleBlock(drafter.block.module, drafter.block.head, fast=False)
    return DFlashDrafter(drafter.name, block, drafter.family, drafter.layers)


def timed_rounds(session, generated: list[int], steps: int, k: int, sampler: Sampler) -> float:
    """ms per round over `steps` rounds, each: the next token commits with nothing accepted, then a draft."""
    started = time.perf_counter()
    for _ in range(steps):
        session.accept(0)
        generated.append(7)
        session.propose(generated, k, sampler)
    return 1000 * (time.perf_counter() - started) / steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.profile_drafts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args(argv)
    target = load_target(os.path.join(DEMO, "target"))
    prompt = Engine(target).prepare(request_messages(demo_requests(1)[0]))
    sampler = Sampler(SamplingSettings())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.rounds} rounds x {args.steps} "
          f"draft rounds of k = {args.k}, module forward then fast path")
    for folder in ("mtp_drafter", "block_drafter"):
        fast = load_drafter(os.path.join(DEMO, folder), target)
        drafters = {"module": module_twin(fast), "fast": fast}
        with torch.inference_mode():
            logits, state = target.runner.prefill(prompt.target_inputs, fast.reads)
            sessions = {name: drafter.begin(prompt, state) for name, drafter in drafters.items()}
            generated = {name: [int(logits.argmax())] for name in drafters}
            for name, session in sessions.items():  # the prompt's round, and warm-up
                session.propose(generated[name], args.k, sampler)
                timed_rounds(session, generated[name], 5, args.k, sampler)
            times = {name: [] for name in drafters}
            for _ in range(args.rounds):
                for name, session in sessions.items():
                    times[name].append(timed_rounds(session, generated[name], args.steps, args.k, sampler))
        print(f"{folder}: {summary(times)}")
    return 0


def summary(times: dict[str, list[float]]) -> str:
    """ms per round of each path (median, best) and module / fast per interleaved round."""
    ratios = [old / new for old, new in zip(times["module"], times["fast"])]
    paths = ", ".join(f"{name} {statistics.median(times[name]):.3f} (best {min(times[name]):.3f}) ms/round"
                      for name in ("module", "fast"))
    return (f"{paths}; module / fast: median {statistics.median(ratios):.2f} "
            f"(rounds: {' '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    sys.exit(main())
