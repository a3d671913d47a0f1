"""Evaluate the bundled demo model through the engine: accuracy, identical answers, acceptance.

    python -m measure.eval [--seed S] [--limit N] [--dtype D] [--draft-tokens K] [--json] [--models DIR]
                          [--per-kind] [--backend llamacpp]

Questions come from `models.demo.world.eval_questions(seed, n)`: a namespace of seeds and a
share of picture contents that training never uses (see the world's docstring). Every
question is answered plainly and with each bundled drafter (text LM, small VLM, n-gram),
greedy. Accuracy is the share of answers that contain the expected answer as whole words,
case-insensitively (`world.answer_matches`). `identical_to_plain` compares token ids. The plain
row also counts right answers per kind of question (`per_kind`; printed with `--per-kind`).
`--backend llamacpp` adds a row for llama.cpp plain on the same weights converted to GGUF
(measure/llamacpp_rows.py): its `identical_to_plain` compares its token ids with this engine's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import replace

from engine.loop import DecodeSettings, Done


def drafter_label(name: str) -> str:
    """Short names for the table: the folder's last part, or 'ngram'."""
    return name.rstrip("/").split("/")[-1]


def answer(engine, question, drafter, decode: DecodeSettings) -> Done:
    return [e for e in engine.stream(question.messages(), drafter=drafter, decode=decode) if isinstance(e, Done)][0]


def evaluate(engine, questions, decode: DecodeSettings, llamacpp=None) -> list[dict]:
    """The plain row, a row per drafter, and with `llamacpp` (engine/backends/llamacpp.py) its plain row."""
    from models.demo.world import answer_matches

    plain = [answer(engine, q, None, decode) for q in questions]
    per_kind: dict[str, dict[str, int]] = {}
    for d, q in zip(plain, questions):
        counts = per_kind.setdefault(q.kind, {"right": 0, "questions": 0})
        counts["right"] += answer_matches(d.text, q.answer)
        counts["questions"] += 1
    rows = [{"mode": "plain", "drafter": None,
             "accuracy": sum(c["right"] for c in per_kind.values()) / len(questions),
             "identical_to_plain": 1.0, "acceptance": None, "per_kind": dict(sorted(per_kind.items()))}]
    if llamacpp is not None:
        from measure.llamacpp_rows import eval_row

        rows.append(eval_row(engine, llamacpp, questions, plain, decode))
    for key, drafter in engine.drafters.items():
        done = [answer(engine, q, key, decode) for q in questions]
        drafted = sum(d.stats.drafted for d in done)
        rows.append({
            "mode": "speculative", "drafter": drafter_label(drafter.name),
            "accuracy": sum(answer_matches(d.text, q.answer) for d, q in zip(done, questions)) / len(questions),
            "identical_to_plain": sum(d.token_ids == p.token_ids for d, p in zip(done, plain)) / len(questions),
            "acceptance": sum(d.stats.accepted for d in done) / drafted if drafted else None,
            "tokens_per_forward": sum(d.stats.decode_tokens for d in done) / max(1, sum(d.stats.target_forwards for d in done)),
        })
    return rows


def main(argv=None) -> int:
    from engine.build import EngineSpec, add_model_flags, build_engine, spec_from_args
    from engine.settings import add_cli_args
    from models.loading import dtype_name
    from models.demo.world import eval_questions
    from models.presets import PRESETS

    parser = argparse.ArgumentParser(prog="python -m measure.eval", description=__doc__.split("\n\n")[0])
    add_model_flags(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=200, help="number of questions")
    add_cli_args(parser, ["draft_tokens", "max_new_tokens"], draft_tokens=4, max_new_tokens=160)  # engine/settings.py
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--per-kind", action="store_true", help="also print plain accuracy per kind of question")
    parser.add_argument("--backend", choices=["llamacpp"], help="also answer plainly with llama.cpp on the same "
                        "weights converted to GGUF (float32 unless --dtype bfloat16) and compare token ids")
    parser.add_argument("--models", help="a folder laid out like assets/demo (target/, text_drafter/, vlm_drafter/), "
                        "e.g. the --out of a training run; default: the bundled models")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    spec = spec_from_args(args)
    if args.models:  # the demo preset's models (or the --drafter names), from a training run's folder
        drafters = spec.drafters if args.drafter else PRESETS["demo"].drafters
        spec = EngineSpec(os.path.join(args.models, "target"),
                          tuple(os.path.join(args.models, os.path.basename(d)) if d != "ngram" else d
                                for d in drafters),
                          replace(spec.options, weight_arithmetic=args.weight_arithmetic or PRESETS["demo"].weight_arithmetic))
    engine = build_engine(spec)
    questions = eval_questions(args.seed, args.limit)
    decode = DecodeSettings(max_new_tokens=args.max_new_tokens, draft_tokens=args.draft_tokens or None)
    llamacpp = None
    if args.backend == "llamacpp":
        from measure.llamacpp_rows import start

        llamacpp = start(engine.target.name, None, "bf16" if dtype_name(engine.target.model) == "bfloat16" else "f32")
    rows = evaluate(engine, questions, decode, llamacpp)
    dtype = dtype_name(engine.target.model)  # --dtype fit resolved
    result = {"questions": len(questions), "seed": args.seed, "dtype": dtype,
              "questions_sha256": hashlib.sha256("\n".join(q.prompt for q in questions).encode()).hexdigest(),
              "rows": rows}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{len(questions)} questions, seed {args.seed}, {dtype}, k={args.draft_tokens} "
          f"({time.perf_counter() - started:.0f} s)")
    print(f"{'mode':<12} {'drafter':<14} {'accuracy':>8} {'identical':>9} {'acceptance':>10} {'tok/fwd':>7}")
    for row in rows:
        acceptance = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        print(f"{row['mode']:<12} {row['drafter'] or '-':<14} {row['accuracy']:>8.1%} "
              f"{row['identical_to_plain']:>9.1%} {acceptance:>10} {row.get('tokens_per_forward', 1.0):>7.2f}")
    for row in rows:
        if row.get("differing"):
            print(f"{row['mode']}: {len(row['differing'])} answers differ from plain, e.g. {row['differing'][0]!r}")
    if args.per_kind:
        print("\nplain, per kind of question (right / questions):")
        for kind, counts in rows[0]["per_kind"].items():
            print(f"  {kind:<30} {counts['right']:>3} / {counts['questions']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
