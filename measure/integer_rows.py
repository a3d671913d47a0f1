"""Float rows against integer rows on the SmolLM2 demo's GGUF blocks (`--weight-arithmetic`), in one
process on the same weights, the two arithmetics taking turns round by round.

    python -m measure.integer_rows [--threads 1] [--rounds 3] [--rows 1,5,9] [--prompts 4] [--tokens 48]

- t(n): a target pass over n tokens after a short prompt, then a rollback (measure/bench_rows.py's
  cost model), the median of `--repeats` passes, in wall-clock ms and in the process's CPU ms
  (on a shared machine the CPU time moves far less than the wall clock; with one thread it is the
  pass's own work);
- agreement: for each prompt, the float rows' greedy answer (`--tokens` tokens), then one pass over
  prompt + answer with each arithmetic: the share of positions whose top-1 token is the same
  (teacher-forced), and where the integer rows' own greedy answer first differs.
A measurement, not a test: figures go to docs/performance.md with this command.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.engine import Engine
from engine.loop import DecodeSettings, Done
from engine.target import load_target
from models.demo import smol
from models.loading import LoadOptions

PROMPTS = ("Write a short poem about the sea.", "What is the capital of France? Answer in one sentence.",
           "Explain what a CPU cache is to a child.", "List three uses of a paperclip.", "How do plants make food?",
           "Tell me a joke about computers.")


def pass_costs(runner, prompt, rows: list[int], repeats: int) -> dict[int, tuple[float, float]]:
    """{n: (median wall ms, median CPU ms)} of a pass over n tokens after `prompt`, rolled back."""
    _, state = runner.prefill(prompt.target_inputs)
    token = prompt.input_ids[-1]
    costs = {}
    for n in rows:
        wall, cpu = [], []
        for _ in range(repeats + 1):  # the first is a warm-up
            w0, c0 = time.perf_counter(), time.process_time()
            runner.extend(state, [token] * n)
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
            runner.rollback(state, n)
        costs[n] = (1000 * statistics.median(wall[1:]), 1000 * statistics.median(cpu[1:]))
    return costs


def agreement(engine, runner, messages, tokens: int) -> tuple[int, int, int | None]:
    """(positions with the same top-1 under both arithmetics, positions, the first token where the
    integer rows' greedy answer leaves the float rows', or None)."""
    decode = DecodeSettings(max_new_tokens=tokens, stop_token_ids=frozenset({-1}))
    answers, logits = {}, {}
    for arithmetic in ("float", "integer"):
        runner.fast.use_weight_arithmetic(arithmetic)
        answers[arithmetic] = [e for e in engine.stream(messages, decode=decode) if isinstance(e, Done)][0].token_ids
    prompt = engine.prepare(messages)
    for arithmetic in ("float", "integer"):
        runner.fast.use_weight_arithmetic(arithmetic)
        first, state = runner.prefill(prompt.target_inputs)
        rest = runner.extend(state, answers["float"][:-1])  # teacher-forced on the float rows' answer
        logits[arithmetic] = torch.cat([first.reshape(-1, rest.shape[-1])[-1:], rest]).argmax(-1)
    same = int((logits["float"] == logits["integer"]).sum())
    differ = next((i for i, (a, b) in enumerate(zip(answers["float"], answers["integer"])) if a != b), None)
    return same, len(logits["float"]), differ


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m measure.integer_rows", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", default="1,5,9")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(str(smol.assemble()), LoadOptions(dtype="float32", device="cpu", weight_arithmetic="integer"))
    runner, engine = target.runner, Engine(target)
    rows = [int(n) for n in args.rows.split(",")]
    prompt = engine.prepare([{"role": "user", "content": PROMPTS[0]}])
    results = {"float": [], "integer": []}
    for _ in range(args.rounds):
        for arithmetic in results:
            runner.fast.use_weight_arithmetic(arithmetic)
            results[arithmetic].append(pass_costs(runner, prompt, rows, args.repeats))
    print(f"t(n) over {args.rounds} rounds, {args.threads} thread(s): wall ms / CPU ms, min-max over rounds")
    for arithmetic, rounds in results.items():
        cells = [f"t({n}) {min(r[n][0] for r in rounds):.1f}-{max(r[n][0] for r in rounds):.1f} / "
                 f"{min(r[n][1] for r in rounds):.1f}-{max(r[n][1] for r in rounds):.1f}" for n in rows]
        print(f"  {arithmetic:8s} " + ", ".join(cells))
    total_same = total = 0
    for text in PROMPTS[:args.prompts]:
        same, count, differ = agreement(engine, runner, [{"role": "user", "content": text}], args.tokens)
        total_same, total = total_same + same, total + count
        print(f"  {text[:40]!r}: top-1 agreement {same}/{count}, greedy answers differ from token "
              f"{'never' if differ is None else differ}")
    print(f"top-1 agreement, teacher-forced on the float rows' answers: {total_same}/{total} "
          f"({100 * total_same / total:.1f} %)")


if __name__ == "__main__":
    main()
