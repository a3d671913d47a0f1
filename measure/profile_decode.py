"""Where a decode step's time goes: torch.profiler over the target's and each drafter's steps.

    python -m measure.profile_decode [--dtype bfloat16] [--drafter-dtype auto] [--steps 200] [--wrapped]

Loads the bundled demo pair as the benchmark does, prefills one benchmark request, then
profiles `steps` single-token steps of the target (a plain decode step) and of each model
drafter (a draft step), each followed by its rollback, and prints per model: milliseconds per
step, the share spent in `aten::linear` (matrix products) and the five most expensive
operators. This is how the benchmark's drafter cost was traced to bfloat16 matmuls on a CPU
(docs/benchmarks.md). `--wrapped` runs every step through the multimodal wrapper's forward, as
the engine did before it called Qwen-VL language models directly.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from engine.build import add_model_flags, build_engine, spec_from_args
from models.loading import dtype_name
from measure.bench import demo_requests, messages_of


def profile_steps(runner, state, token: int, steps: int) -> tuple[float, list]:
    """(ms per step without the profiler, profiler's per-operator averages)."""
    def step():
        runner.checkpoint(state)  # a hybrid model (Qwen3.5) rolls back to here
        runner.extend(state, [token])
        runner.rollback(state, 1)

    for _ in range(20):
        step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    ms = 1000 * (time.perf_counter() - started) / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return ms, prof.key_averages()


def report(name: str, ms: float, averages, steps: int) -> None:
    total = sum(e.self_cpu_time_total for e in averages)
    linear = sum(e.cpu_time_total for e in averages if e.key == "aten::linear")
    top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:5]
    print(f"{name}: {ms:.2f} ms/step; aten::linear {100 * linear / total:.0f} % of profiled CPU time")
    for e in top:
        print(f"    {e.key:<40} {e.self_cpu_time_total / steps / 1000:.3f} ms/step ({e.count // steps} calls)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.profile_decode", description=__doc__.split("\n\n")[0])
    add_model_flags(parser)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--wrapped", action="store_true", help="full multimodal forward for every step")
    args = parser.parse_args(argv)
    spec = spec_from_args(args)
    engine = build_engine(replace(spec, drafters=tuple(d for d in spec.drafters if d != "ngram")))
    if args.wrapped:
        for runner in [engine.target.runner] + [d.runner for d in engine.drafters.values() if hasattr(d, "runner")]:
            runner.family = replace(runner.family, direct_text_steps=False)
    messages = messages_of(demo_requests(1)[0])
    prompt = engine.prepare(messages)
    token = prompt.input_ids[-1]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, target {dtype_name(engine.target.model)}, "
          f"drafters {args.drafter_dtype}" + (", full multimodal forward" if args.wrapped else ""))
    _, state = engine.target.runner.prefill(prompt.target_inputs)
    report("target", *profile_steps(engine.target.runner, state, token, args.steps), args.steps)
    for drafter in engine.drafters.values():
        if drafter.kind not in ("text_lm", "vlm"):
            continue  # only drafters that are their own model have single-token steps to profile
        session = drafter.begin(prompt, state)
        dtype = next(drafter.runner.model.parameters()).dtype
        label = f"{drafter.name.rstrip('/').split('/')[-1]} ({str(dtype).removeprefix('torch.')})"
        report(label, *profile_steps(drafter.runner, session.state, token, args.steps), args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
