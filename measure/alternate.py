"""Plain decoding of this engine and of llama.cpp on the same weights, in alternating processes.

    python -m measure.alternate [--preset smolvlm-256m|qwen2.5-vl-3b|demo] [--dtype bfloat16|float32]
                                [--int8 | --quantization w8a8|q4_0] [--rounds 3]
                                [--repeats 5] [--max-new-tokens 32] [--threads 2]

One request's text turn (measure/realscale.py's request without its image: llama.cpp refuses the
random SmolVLM shape's images), greedy, `--max-new-tokens` tokens that never stop early, on a
preset's random-weight shape (measure/shapes.py) or on `demo`, the bundled model. Each
round runs this engine in a fresh process, then llama.cpp in another (the GGUF that
measure/realscale.py converts: bf16 for a bfloat16 target, f32 with `--dtype float32`, Q8_0 with `--int8` or `--quantization
int8|w8a8`; with `--quantization q4_0` Q4_0 of the same weights, and a third process per round on
llama.cpp's Q4_K_M mix, both made by llama-quantize: engine/backends/llamacpp_native.py; llama.cpp
built for this CPU where it has been built), so neither
shares an OpenMP runtime or memory with the other, and a machine that slows down or speeds up
during the run moves both sides of a round alike. Each process warms up (pages its weights in),
decodes the turn once untimed (warm-up), then `--repeats` times and reports the median decode tokens/s. Printed: every
process's figure and the median of the rounds' ratios, and beside them the machine's streaming-read
bandwidth for 1 and `--threads` threads (measure/bandwidth.py) before and after the rounds, and this engine's
speed as a fraction of its bound: the bytes of weights it reads a token (llamacpp_rows.bytes_read:
an untied input embedding counts one row) at the higher of the two streaming reads. A measurement, not a test: on a shared
machine read the rounds' spread before the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import torch

from measure.bench_rows import interleaved
from measure.realscale import QUANTIZED_GGUF, UNQUANTIZED_GGUF


# --quantization: llama.cpp's GGUF beside each of this engine's (and the sides after "this"): Q4_K_M,
# llama.cpp's common 4-bit default, beside Q4_0
GGUFS = {q: (gguf,) + (("q4_k_m",) if q == "q4_0" else ()) for q, gguf in QUANTIZED_GGUF.items()}


def sides(quantization: str | None) -> list[str]:
    """"this", then "llama.cpp" (the GGUF of the same weights), then "llama.cpp <type>" for the others
    that can be made here (Q4_K_M: where llama-quantize is built)."""
    from engine.backends.llamacpp_native import QUANTIZE, binary

    others = GGUFS.get(quantization, ())[1:]
    return ["this", "llama.cpp"] + [f"llama.cpp {other}" for other in others if binary(QUANTIZE)]


def target_folder(preset: str) -> str:
    """The bundled model for `demo`, else the preset's random-weight shape (built once)."""
    if preset == "demo":
        from models.presets import DEMO_MODEL

        return DEMO_MODEL
    from measure.shapes import build_preset

    return str(build_preset(preset, False)[0])


def decode_speeds(side: str, preset: str, dtype: str, quantization: str | None, repeats: int,
                  max_new_tokens: int) -> dict:
    """{"speeds": decode tokens/s of `repeats` runs of the text turn on `side` (one of `sides`),
    "bytes_read": the bytes of weights this engine reads a token (None for llama.cpp)}."""
    from engine.loop import DecodeSettings
    from measure.llamacpp_rows import text_only
    from measure.realscale import photo

    target_dir = target_folder(preset)
    messages = text_only([{"role": "user", "content": [{"type": "image", "image": photo(112)},
                                                       {"type": "text", "text": "Describe this image in detail."}]}])
    decode = DecodeSettings(max_new_tokens=max_new_tokens, stop_token_ids=frozenset({-1}))  # never stops early
    if side == "this":
        from engine.engine import Engine
        from engine.target import load_target, quantize_fast
        from measure.bench_rows import run_this
        from measure.llamacpp_rows import bytes_read
        from models.loading import LoadOptions

        target = load_target(str(target_dir), LoadOptions(dtype=dtype, device="cpu"))
        if quantization:
            quantize_fast(target.runner, str(target_dir), quantization)
            native = target.runner.fast.stack.native
            print(f"this engine: int8 activations' kernel {native.int8_kernel() if native else 'none (Python)'}",
                  file=sys.stderr)
        engine = Engine(target, {})
        run_this(engine, None, messages, decode, 0)  # warm-up: one whole untimed answer
        return {"speeds": [run_this(engine, None, messages, decode, i).decode_tok_s for i in range(repeats)],
                "bytes_read": bytes_read(target)}
    from measure.llamacpp_rows import answer, start

    outtype = side.split()[1] if " " in side else (GGUFS[quantization][0] if quantization else UNQUANTIZED_GGUF[dtype])
    backend = start(str(target_dir), None, outtype)
    print(f"llama.cpp: {backend.server.kind}", file=sys.stderr)
    answer(backend, messages, None, decode)  # warm-up: one whole untimed answer
    return {"speeds": [answer(backend, messages, None, decode).stats.decode_tok_s for _ in range(repeats)],
            "bytes_read": None}


def bandwidths(threads: int) -> dict[int, float]:
    """Streaming-read GB/s on 1 and on `threads` threads (measure/bandwidth.py), printed."""
    from measure.bandwidth import streaming_read

    measured = {n: streaming_read(n) for n in sorted({1, threads})}
    print("streaming read: " + ", ".join(f"{gb:.1f} GB/s on {n}" for n, gb in measured.items()), flush=True)
    return measured


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.alternate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="smolvlm-256m", help="a measure/shapes.py preset, or demo (the bundled model)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(UNQUANTIZED_GGUF),
                        help="this engine's dtype; llama.cpp's GGUF of the same (unquantized)")
    parser.add_argument("--int8", action="store_true", help="this engine with --quantization int8, llama.cpp Q8_0")
    parser.add_argument("--quantization", choices=sorted(QUANTIZED_GGUF), help="this engine with "
                        "--quantization int8 or w8a8, llama.cpp Q8_0; q4_0: llama.cpp Q4_0, and Q4_K_M beside it")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--side", help=argparse.SUPPRESS)  # one process's part: one of sides()
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    quantization = args.quantization or ("int8" if args.int8 else None)
    if args.side:
        print(json.dumps(decode_speeds(args.side, args.preset, args.dtype, quantization, args.repeats,
                                       args.max_new_tokens)))
        return 0
    before = bandwidths(args.threads)
    if quantization and len(sides(quantization)) < len(GGUFS[quantization]) + 1:
        print(f"not measured: {', '.join(GGUFS[quantization][1:])} (llama-quantize is not built: "
              "python -m engine.backends.llamacpp_native --quantize)", flush=True)

    def median_speed(round_index: int, side: str) -> float:
        command = [sys.executable, "-m", "measure.alternate", f"--side={side}", "--preset", args.preset,
                   "--repeats", str(args.repeats), "--max-new-tokens", str(args.max_new_tokens),
                   "--threads", str(args.threads), "--dtype", args.dtype] + (
                       ["--quantization", quantization] if quantization else [])
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        speeds, read[side] = figures["speeds"], figures["bytes_read"]
        if round_index == 0:  # which build and kernel each side ran
            print("\n".join(line for line in done.stderr.splitlines() if line.startswith(("llama.cpp:", "this engine:"))))
        print(f"round {round_index + 1}, {side}: {' '.join(f'{s:.2f}' for s in speeds)} tok/s "
              f"(median {statistics.median(speeds):.2f})", flush=True)
        return statistics.median(speeds)

    read: dict[str, int | None] = {}  # each side's bytes of weights read a token (this engine's only)
    medians = interleaved(args.rounds, sides(quantization), median_speed)
    after = bandwidths(args.threads)
    ggufs = GGUFS[quantization] if quantization else (UNQUANTIZED_GGUF[args.dtype],)
    for other, gguf in zip(sides(quantization)[1:], ggufs):
        ratios = [this / speed for this, speed in zip(medians["this"], medians[other])]
        print(f"{args.preset}, {quantization or args.dtype} / {gguf.upper()}, {args.threads} threads, "
              f"{args.max_new_tokens} tokens: this engine / llama.cpp, median of rounds "
              f"{statistics.median(ratios):.2f}x (rounds: {' '.join(f'{r:.2f}' for r in ratios)})")
    # the bound: the bytes this engine reads a token at the higher streaming read of before and after
    bandwidth, weights = max(before[args.threads], after[args.threads]), read["this"]
    fractions = [speed * weights / (bandwidth * 1e9) for speed in medians["this"]]
    print(f"{args.preset}, {quantization or args.dtype}: this engine / streaming-read bound ({weights / 1e6:.1f} MB "
          f"read a token at {bandwidth:.1f} GB/s on {args.threads} threads: {bandwidth * 1e9 / weights:.1f} tok/s), "
          f"median of rounds {statistics.median(fractions):.2f}x (rounds: {' '.join(f'{f:.2f}' for f in fractions)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
