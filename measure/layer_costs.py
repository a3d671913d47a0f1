"""What a fast-path decode pass spends outside its matrix products, part by part.

    python -m measure.layer_costs [--shape smolvlm-256m] [--dtype bfloat16] [--threads 2] [--rounds 5]

On a measure/shapes.py architecture with random weights (or `--shape demo`, the bundled model),
one process, interleaved round by round, 20 passes of one token after a 64-token prompt each:
- `compiled`: the fast path's pass as the engine runs it (`Runner.extend`, then a rollback)
  with the compiled stack (engine/fast_native.py), where this machine builds it;
- `full`: the same pass with the Python layer (engine/fast_decode.decoder_layer);
- `without X`: the Python layer's pass with one part of every decoder layer left out (the
  reference layer's own `left_out`: its output replaced by its input, so the products still run
  on tensors of the same shapes): `norm` (both
  RMSNorms), `rotary`, `write` (the K/V cache writes), `attention` (SDPA), `silu` (SiLU and the
  gate product), and `all` of them;
- `products`: the pass's matrix products alone, the same weights in the same order, with inputs
  made once.
Prints each variant's median ms per pass and what leaving the part out saved. The answers of the
`without` variants are wrong by design; only their times mean anything. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from dataclasses import replace

import torch

from engine import fast_decode, quantized
from engine.fast_decode import linear

PARTS = ("norm", "rotary", "write", "attention", "silu")  # what engine/fast_decode.decoder_layer can leave out


def layer_without(parts: set[str]):
    """engine/fast_decode.decoder_layer with `parts` left out (same products, same shapes)."""
    return functools.partial(fast_decode.decoder_layer, left_out=frozenset(parts))


def products_of(decoder: fast_decode.FastDecoder):
    """The pass's products alone: each layer's four and the output layer's, inputs made once."""
    dtype = decoder.final_norm.dtype
    width = lambda weight: (weight.values.shape[1] if isinstance(weight, quantized.Int8Weight)  # noqa: E731
                            else weight.shape[0])
    inputs = [[torch.zeros(1, width(w), dtype=dtype) for w in (layer.qkv_weight, layer.o_weight,
                                                               layer.gate_up_weight, layer.down_weight)]
              for layer in decoder.stack.layers]
    head_input = torch.zeros(1, width(decoder.head_weight), dtype=dtype)

    def products():
        for layer, (x_qkv, x_o, x_gate_up, x_down) in zip(decoder.stack.layers, inputs):
            linear(x_qkv, layer.qkv_weight, layer.qkv_bias)
            linear(x_o, layer.o_weight, layer.o_bias)
            linear(x_gate_up, layer.gate_up_weight)
            linear(x_down, layer.down_weight)
        linear(head_input, decoder.head_weight)
    return products


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.layer_costs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smolvlm-256m", help="a measure/shapes.py architecture, or demo")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine.runner import Runner
    from measure.profile_decode import shape_target

    if args.shape == "demo":
        from engine.build import add_model_flags, build_engine, spec_from_args

        flags = argparse.ArgumentParser()
        add_model_flags(flags)
        target = build_engine(replace(spec_from_args(flags.parse_args(["--dtype", args.dtype])), drafters=())).target
        model, family = target.model, target.family
    else:
        model, family = shape_target(args.shape, None, args.dtype)
    runner = Runner(model, family)
    ids = torch.randint(16, model.config.get_text_config().vocab_size, (1, 64))
    native = runner.fast.stack.native
    variants = {**({"compiled": "compiled"} if native else {}), "full": None,
                **{f"without {p}": layer_without({p}) for p in PARTS},
                "without all": layer_without(set(PARTS))}
    times = {name: [] for name in [*variants, "products"]}
    with torch.inference_mode():
        _, state = runner.prefill({"input_ids": ids, "attention_mask": torch.ones_like(ids)})

        def step():
            runner.extend(state, [7])
            runner.rollback(state, 1)

        def per_pass(fn, passes: int = 20) -> float:
            for _ in range(3):
                fn()
            started = time.perf_counter()
            for _ in range(passes):
                fn()
            return 1000 * (time.perf_counter() - started) / passes

        products = products_of(runner.fast)
        for _ in range(args.rounds):
            for name, layer_fn in variants.items():
                runner.fast.stack.native = native if layer_fn == "compiled" else None
                runner.fast.stack.layer_fn = fast_decode.decoder_layer if layer_fn in (None, "compiled") else layer_fn
                times[name].append(per_pass(step))
            runner.fast.stack.layer_fn = fast_decode.decoder_layer
            times["products"].append(per_pass(products))
    full = statistics.median(times["full"])
    print(f"{args.shape}, {args.dtype}, {args.threads} threads, one token after 64, {args.rounds} rounds x 20 passes")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:>18}: {median:7.2f} ms a pass (saves {full - median:+.2f}; rounds "
              f"{' '.join(f'{v:.2f}' for v in values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
