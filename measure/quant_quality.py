"""The quality cost of the fast path's quantized weights (int8, w8a8, q4_0): a quantized target's
greedy choices against the same target unquantized, on the same tokens.

    python -m measure.quant_quality [--preset demo | --preset smolvlm-256m] [--dtype bfloat16]
                                    [--quantization int8,w8a8,q4_0] [--prompts 20] [--tokens 64]

For each prompt (the demo's eval questions with their images, models.demo.world.eval_questions;
for a random-weight shape, measure/shapes.py, text turns), the unquantized target decodes its
greedy answer and the quantized one reads the same tokens (teacher forcing): `top-1` is the share
of decode passes whose most likely next token is the same, `first divergence` the decode step
where the quantized target's greedy answer would first differ (that many tokens are identical;
`tokens` when none differs). Prefill runs the model's own weights in both (transformers' forward):
the first token is always the same and is not counted. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch


def prompts(preset: str, count: int) -> tuple[str, list[list[dict]]]:
    """The target's folder and `count` conversations."""
    if preset == "demo":
        from models.demo.world import eval_questions
        from models.presets import ASSETS

        return os.path.join(ASSETS, "target"), [q.messages() for q in eval_questions(0, count)]
    from measure.shapes import build_preset

    target_dir, _ = build_preset(preset, False)
    texts = ["Describe this image in detail.", "What is in the picture?", "Write a story about a cat.",
             "List three colours.", "Explain how a bicycle works."]
    return str(target_dir), [[{"role": "user", "content": [{"type": "text", "text": f"{texts[i % len(texts)]} ({i})"}]}]
                             for i in range(count)]


@torch.no_grad()
def agreement(reference, quantized, inputs, tokens: int) -> list[bool]:
    """Per decode step: whether both targets' most likely next token is the same, on the reference's
    greedy tokens."""
    (logits, reference_state), (_, quantized_state) = reference.runner.prefill(inputs), quantized.runner.prefill(inputs)
    token, same = int(logits.argmax()), []
    for _ in range(tokens):
        expected = reference.runner.extend(reference_state, [token])
        got = quantized.runner.extend(quantized_state, [token])
        same.append(int(expected.argmax()) == int(got.argmax()))
        token = int(expected.argmax())
    return same


def main(argv=None) -> int:
    from engine.engine import Engine
    from engine.target import load_target
    from models.loading import LoadOptions

    parser = argparse.ArgumentParser(prog="python -m measure.quant_quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="demo", help="demo (the bundled model) or a measure/shapes.py preset")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default="int8,w8a8,q4_0")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target_dir, conversations = prompts(args.preset, args.prompts)
    reference = load_target(target_dir, LoadOptions(dtype=args.dtype, device="cpu"))
    inputs = [Engine(reference).prepare(messages).target_inputs for messages in conversations]
    for quantization in args.quantization.split(","):
        quantized = load_target(target_dir, LoadOptions(dtype=args.dtype, device="cpu", quantization=quantization))
        runs = [agreement(reference, quantized, prompt, args.tokens) for prompt in inputs]
        firsts = [run.index(False) if False in run else len(run) for run in runs]
        top1 = sum(map(sum, runs)) / sum(map(len, runs))
        print(f"{args.preset} {args.dtype}, {quantization} against unquantized, {len(runs)} prompts x {args.tokens} "
              f"decode steps: top-1 {top1:.1%}; first divergence median {statistics.median(firsts)} (min {min(firsts)}, "
              f"answers identical throughout {sum(f == args.tokens for f in firsts)} of {len(runs)})", flush=True)
        del quantized
    return 0


if __name__ == "__main__":
    sys.exit(main())
