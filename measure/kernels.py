"""Kernels for few rows: one product y = x W^T, W a bfloat16 weight (out, in), x (n, in) bfloat16
with n = 1 .. 9 (a decode pass has one row, a verify pass n), at the product shapes of
SmolVLM-256M and Qwen2.5-VL-3B, for each candidate kernel (docs/performance.md, "Kernels for few
rows").

    python -m measure.kernels [--shapes smolvlm,3b] [--rows 1,2,3,5,9] [--threads 1,2]
                              [--kinds in,out,compiled,int8] [--rounds 5] [--cold-mb 300]

Kinds: `in` torch's F.linear on an input-major weight ((in, out) contiguous: the Python layer's
layout, engine/fast_decode.py, where the compiled stack is not built); `out` F.linear on
nn.Linear's (out, in); `compiled` the compiled stack's rows kernel on the (out, in) weight
(engine/fast_layer.cpp: AVX-512 where this CPU has it), `compiled:avx2` / `compiled:portable` the
kernels CPUs without AVX-512 run (the same sums); `int8` the fast path's `--quantization int8`
(half the bytes: a reference, not a bf16 kernel). The kinds tried and rejected on the way to the
rows kernel (oneDNN's packed weights and inner product, upcast tiles: docs/performance.md, "What
was tried") are no longer here.

Each product reads a weight the CPU has not just read: every kind holds copies of its weight
totalling `--cold-mb` (more than this CPU's 260 MB L3 with the other kinds' copies read in
between), and one timing is a sweep over its copies, one product each; a whole decode pass
streams every layer's weights the same way. A cell is the best over `rounds` rounds of the us per
product (on this shared machine the median moves 2-8x from run to run, the best far less);
within a round the thread counts and kinds are interleaved. Also printed per kind: the largest
difference from a float64 product, relative to the largest |y| (first 8192 outputs).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F

from engine import fast_decode, fast_native, quantized

SHAPES = {  # name: (out, in)
    "smolvlm": {"qkv 576->960": (960, 576), "o 576->576": (576, 576), "gate/up 576->3072": (3072, 576),
                "down 1536->576": (576, 1536), "head 576->49280": (49280, 576)},
    "3b": {"qkv 2048->2560": (2560, 2048), "o 2048->2048": (2048, 2048), "gate/up 2048->22016": (22016, 2048),
           "down 11008->2048": (2048, 11008)},
    "3b-head": {"head 2048->151936": (151936, 2048)},  # 622 MB a copy: run it alone, with few kinds
}


def make(kind: str, weight: torch.Tensor):
    """kind's product x (n, in) -> y (n, out) for a bfloat16 weight (out, in), over its own copy."""
    if kind == "in":
        input_major = weight.t().contiguous().t()  # (out, in), stored (in, out)
        return lambda x: F.linear(x, input_major)
    if kind == "out":
        return lambda x, w=weight.clone(): F.linear(x, w)
    if kind == "int8":
        return lambda x, w=quantized.Int8Weight.quantize(weight.t()): fast_decode.linear(x, w)
    if kind.startswith("compiled"):  # compiled:NAME, one of the build's rows kernels
        native = fast_native.layer()
        if native is None:
            raise SystemExit(f"no compiled rows kernel here: {fast_native.unavailable()}")
        kernel = kind.partition(":")[2] or native.rows_kernel()
        if kernel not in native.rows_kernels_built():
            raise SystemExit(f"no rows kernel {kernel!r} here (built: {', '.join(native.rows_kernels_built())})")

        def product(x, w=weight.clone().t()):  # (in, out) view of (out, in)
            in_use = native.rows_kernel()
            native.use_rows_kernel(kernel)
            try:
                return native.product(x, w, None)
            finally:
                native.use_rows_kernel(in_use)
        return product
    raise SystemExit(f"unknown kind {kind!r}")


def weight_bytes(kind: str, weight: torch.Tensor) -> int:
    return weight.numel() * (1 if kind == "int8" else 2)


def measure_shape(name: str, out: int, inp: int, kinds: list[str], rows: list[int], thread_counts: list[int],
                  rounds: int, cold_bytes: int) -> dict:
    """{(kind, n, threads): best us per product} for one shape; prints each row as it comes."""
    torch.manual_seed(0)
    weight = (torch.randn(out, inp) * 0.02).bfloat16()
    copies = {kind: [make(kind, weight) for _ in range(max(1, math.ceil(cold_bytes / weight_bytes(kind, weight))))]
              for kind in kinds}
    cells = {}
    for n in rows:
        x = torch.randn(n, inp).bfloat16()
        checked = min(out, 8192)  # the first outputs against a float64 product
        exact = x.double() @ weight[:checked].double().t()
        errors = {kind: float((copies[kind][0](x)[:, :checked].double() - exact).abs().max() / exact.abs().max())
                  for kind in kinds}
        samples = {(kind, threads): [] for kind in kinds for threads in thread_counts}
        for _ in range(rounds):
            for threads in thread_counts:
                torch.set_num_threads(threads)
                for kind in kinds:
                    products = copies[kind]
                    products[-1](x)  # warm the primitive caches (the sweep reads this copy last)
                    started = time.perf_counter()
                    for product in products:
                        product(x)
                    samples[kind, threads].append(1e6 * (time.perf_counter() - started) / len(products))
        for threads in thread_counts:
            base = min(samples[kinds[0], threads])
            parts = []
            for kind in kinds:
                us = cells[kind, n, threads] = min(samples[kind, threads])
                parts.append(f"{kind} {us:,.0f} ({base / us:.2f}x)")
            print(f"  {name}, {n} row(s), {threads} thr: " + "; ".join(parts), flush=True)
        print("    max |y - exact| / max |y|: " + ", ".join(f"{kind} {errors[kind]:.1e}" for kind in kinds))
    return cells


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="smolvlm,3b", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--rows", default="1,2,3,5,9")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--kinds", default="in,out,compiled,int8",
                        help="the first is the baseline of the ratios; of in, out, compiled[:KERNEL], int8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cold-mb", type=float, default=300, help="each kind's copies of a weight, MB")
    args = parser.parse_args(argv)
    kinds, rows = args.kinds.split(","), [int(n) for n in args.rows.split(",")]
    thread_counts = [int(t) for t in args.threads.split(",")]
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"torch {torch.__version__}; us per product y = x W^T (bf16), best of {args.rounds} rounds, "
          f"kinds and threads interleaved; (Nx) = {kinds[0]}'s time / the kind's; load average {' '.join(load)}")
    with torch.inference_mode():
        for group in args.shapes.split(","):
            cells = [measure_shape(name, out, inp, kinds, rows, thread_counts, args.rounds, int(args.cold_mb * 1e6))
                     for name, (out, inp) in SHAPES[group].items()]
            print(f"{group}: t(n)/t(1) of the shapes' products summed, n = {' / '.join(map(str, rows))}")
            for threads in thread_counts:
                for kind in kinds:
                    total = {n: sum(c[kind, n, threads] for c in cells) for n in rows}
                    print(f"  {threads} thr {kind}: {total[rows[0]]:,.0f} us; "
                          + " / ".join(f"{total[n] / total[rows[0]]:.2f}" for n in rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
