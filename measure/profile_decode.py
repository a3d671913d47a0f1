"""Where a decode step's time goes, and the fast path against transformers' forward.

    python -m measure.profile_decode [--dtype bfloat16] [--drafter-dtype auto] [--steps 200] [--wrapped]
    python -m measure.profile_decode --compare [--shape smolvlm-256m [--layers N]] [--dtype bfloat16]
                                     [--verify 1] [--rounds 5] [--steps 50] [--int8 | --compile MODE]
    python -m measure.profile_decode --layouts [--kinds bf16-in,int8] [--threads 1,2]

Default: loads the bundled demo pair as the benchmark does, prefills one benchmark request,
then profiles `steps` single-token steps of the target (a plain decode step) and of each model
drafter (a draft step), each followed by its rollback, and prints per model: milliseconds per
step, the share spent in `aten::linear` (matrix products) and the five most expensive
operators. `--wrapped` runs every step through the multimodal wrapper's forward.

`--compare`: today's path (transformers' forward, `Runner(fast=False)`) against the fast path
(engine/fast_decode.py) on one target, in one process, interleaved: `rounds` rounds of `steps`
passes over `--verify` tokens each (then rolled back), old then new then old...; prints each
path's median ms per pass, the median of the per-round ratios, the profile of a pass (time in
matrix products, attention, other operators, and outside operators: Python and dispatch), the
bytes of weights a pass reads, the bandwidth that implies, a matrix-vector product's bandwidth
measured here, and the bound (bytes / that bandwidth). `--shape` builds a measure/shapes.py
architecture with random weights in memory (`--layers N` keeps N decoder layers: a layer-scaled
view of a model too large to hold; the per-layer figures scale). `--int8`: the fast path against
the fast path with int8 weights (`--quantization int8`) instead of today's path; `--compile MODE`
against the fast path's forward through torch.compile (default, max-autotune-no-cudagraphs,
inductor freezing, cpp wrapper), with the compile cost of its first passes and the graphs made.

`--layouts [--kinds f32,f32-in,bf16,bf16-in,int8,torchao,bnb8] [--threads 1,2]`: one product
y = x W^T at SmolVLM-256M's and Qwen2.5-VL-3B's shapes, x of 1 and 5 rows, with W stored float32
or bfloat16, (out, in) (nn.Linear's layout) or (in, out) ("-in"), or int8 with per-channel scales
(the fast path's `--quantization int8`), torchao's int8 weight-only tensor or bitsandbytes' 8-bit
Linear: the best of 3 x 30 runs each, kinds and thread counts interleaved. This is what chose engine/fast_decode.py's layouts.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from engine import fast_decode, quantized
from engine.build import add_model_flags, build_engine, spec_from_args
from engine.runner import Runner
from models.loading import dtype_name
from measure.bench import demo_requests, request_messages

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::mv",
           "aten::_weight_int8pack_mm")


def profile_steps(runner, state, token: int, steps: int, num_tokens: int = 1) -> tuple[float, list]:
    """(ms per pass without the profiler, profiler's per-operator averages)."""
    ms = timed(runner, state, token, steps, num_tokens, warmup=20)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        timed(runner, state, token, steps, num_tokens, warmup=0)
    return ms, prof.key_averages()


def timed(runner, state, token: int, steps: int, num_tokens: int = 1, warmup: int = 3) -> float:
    """ms per pass over `steps` passes over `num_tokens` tokens, each rolled back, after `warmup`."""
    def step():
        runner.checkpoint(state)  # a hybrid model (Qwen3.5) rolls back to here
        runner.extend(state, [token] * num_tokens)
        runner.rollback(state, num_tokens)

    for _ in range(warmup):
        step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return 1000 * (time.perf_counter() - started) / steps


def report(name: str, ms: float, averages, steps: int) -> None:
    total = sum(e.self_cpu_time_total for e in averages)
    linear = sum(e.cpu_time_total for e in averages if e.key == "aten::linear")
    top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:5]
    print(f"{name}: {ms:.2f} ms/step; aten::linear {100 * linear / total:.0f} % of profiled CPU time")
    for e in top:
        print(f"    {e.key:<40} {e.self_cpu_time_total / steps / 1000:.3f} ms/step ({e.count // steps} calls)")


def split(averages, steps: int, ms: float) -> str:
    """A pass's time by kind: matrix products, attention, other operators, outside operators."""
    def ms_of(keys=None, exclude=()):
        return sum(e.self_cpu_time_total for e in averages
                   if (keys is None or e.key in keys) and e.key not in exclude) / steps / 1000

    matmul, attention = ms_of(MATMULS), ms_of({"aten::_scaled_dot_product_flash_attention_for_cpu"})
    ops = ms_of()
    calls = sum(e.count for e in averages if e.key.startswith("aten::")) // steps
    return (f"products {matmul:.3f} ms, attention {attention:.3f}, other ops {ops - matmul - attention:.3f}, "
            f"outside ops (Python, dispatch) {max(ms - ops, 0):.3f}; {calls} aten calls")


def weight_bytes(model) -> int:
    """Bytes of weights one decode pass reads: the text stack's and the output layer's (the
    input embedding table is read one row a token)."""
    stack = fast_decode.text_stack(model)
    head = model.get_output_embeddings().weight
    stack_bytes = sum(p.numel() * p.element_size() for name, p in stack.named_parameters() if "embed" not in name)
    return stack_bytes + head.numel() * head.element_size()


def gemv_bandwidth(dtype: torch.dtype, size: int = 8192, repeats: int = 20) -> float:
    """GB/s of a (1, size) x (size, size) product, the best of `repeats` (the bound's bandwidth)."""
    weight, x = torch.randn(size, size).to(dtype), torch.randn(1, size).to(dtype)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.nn.functional.linear(x, weight)
        best = min(best, time.perf_counter() - started)
    return weight.numel() * weight.element_size() / best / 1e9


LAYOUT_SHAPES = {"qkv 576->960": (960, 576), "gate/up 576->3072": (3072, 576), "down 1536->576": (576, 1536),
                 "head 576->49280": (49280, 576), "3B gate/up 2048->22016": (22016, 2048),
                 "3B down 11008->2048": (2048, 11008)}


def layout_products(weight: torch.Tensor, kinds: list[str]) -> dict:
    """{kind: (x (rows, in) -> y (rows, out))} for one float32 weight (out, in) stored each way:
    f32 / bf16 (out, in) or (in, out), int8 per-channel (engine/quantized.Int8Weight), or
    torchao's int8 weight-only tensor (`torchao` kind; only where torchao is installed), or
    bitsandbytes' 8-bit Linear (`bnb8`). Every
    kind but f32 / f32-in takes a bfloat16 x."""
    bf16 = weight.bfloat16()
    stored = {"f32": weight, "f32-in": weight.t().contiguous().t(), "bf16": bf16, "bf16-in": bf16.t().contiguous().t()}
    products = {kind: (lambda x, w=stored[kind]: F.linear(x, w)) for kind in kinds if kind in stored}
    if "int8" in kinds:
        products["int8"] = lambda x, w=quantized.Int8Weight.quantize(bf16.t()): fast_decode.linear(x, w)
    if "torchao" in kinds:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=torch.bfloat16)
        linear.weight.data = bf16.clone()
        quantize_(linear, Int8WeightOnlyConfig())
        products["torchao"] = linear
    if "bnb8" in kinds:  # bitsandbytes' 8-bit Linear (`--quantization 8bit`), quantized on the move to a device
        import bitsandbytes as bnb

        linear = bnb.nn.Linear8bitLt(weight.shape[1], weight.shape[0], bias=False, has_fp16_weights=False)
        linear.weight = bnb.nn.Int8Params(bf16.clone(), requires_grad=False, has_fp16_weights=False)
        products["bnb8"] = linear.to("cpu")
    return products


def layouts(kinds: list[str], thread_counts: list[int], rounds: int = 3, runs: int = 30) -> None:
    """Microseconds of one product per weight storage kind and thread count: the best of
    `rounds` x `runs`, the kinds and thread counts interleaved within each round."""
    def best(fn, x) -> float:
        fastest = float("inf")
        for _ in range(runs):
            started = time.perf_counter()
            fn(x)
            fastest = min(fastest, time.perf_counter() - started)
        return 1e6 * fastest

    print(f"torch {torch.__version__}; us per product y = x W^T, best of {rounds} x {runs}, interleaved; "
          f"kinds {' / '.join(kinds)} (16-bit and int8 kinds take a bf16 x)")
    threads_before = torch.get_num_threads()
    for name, (out, inp) in LAYOUT_SHAPES.items():
        products = layout_products(torch.randn(out, inp), kinds)
        for rows in (1, 5):
            x = torch.randn(rows, inp)
            times = {(kind, threads): float("inf") for kind in kinds for threads in thread_counts}
            for _ in range(rounds):
                for threads in thread_counts:
                    torch.set_num_threads(threads)
                    for kind in kinds:
                        x_of_kind = x if kind.startswith("f32") else x.bfloat16()
                        times[kind, threads] = min(times[kind, threads], best(products[kind], x_of_kind))
            cells = [f"{threads} thr " + " / ".join(f"{times[kind, threads]:.0f}" for kind in kinds)
                     for threads in thread_counts]
            print(f"  {name}, {rows} row(s): " + "; ".join(cells))
    torch.set_num_threads(threads_before)


def shape_target(name: str, layers: int | None, dtype: str):
    """(model, family) of a measure/shapes.py architecture, random weights, built in memory; its
    vision tower keeps one layer (a decode pass never runs it)."""
    from transformers import AutoModelForImageTextToText

    from measure import shapes
    from models.families import family_for_config
    from models import tiny

    shape = shapes.SHAPES[name]
    shape = dict(shape, vision=dict(shape["vision"], **({"depth": 1, "fullatt_block_indexes": [0]}
                                                         if "depth" in shape["vision"] else {"num_hidden_layers": 1})))
    text = dict(shape["text"], **({"num_hidden_layers": layers} if layers else {}))
    config = shapes._vlm_config(shape, text, tiny._tokenizer(tiny._TOKENS[shape["family"]]), quick=False)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=getattr(torch, dtype)).eval()
    return model, family_for_config(config)


COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "freezing", "cpp-wrapper")


def compiled(decoder: fast_decode.FastDecoder, mode: str) -> None:
    """decoder.forward through torch.compile (dynamic shapes: the cache length and the number of
    tokens vary); `freezing` / `cpp-wrapper`: the default mode with that inductor option."""
    import torch._inductor.config as inductor

    inductor.freezing, inductor.cpp_wrapper = mode == "freezing", mode == "cpp-wrapper"
    decoder.forward = torch.compile(decoder.forward, dynamic=True,
                                    mode="max-autotune-no-cudagraphs" if mode.startswith("max") else None)


def compare(model, family, rounds: int, steps: int, num_tokens: int, input_major: bool | None = None,
            prompt_len: int = 64, int8: bool = False, compile_mode: str | None = None) -> None:
    """Today's Runner against the fast one (on a copy of the model: the fast path lays its weights
    out anew), interleaved round by round, then profiled. int8 / compile_mode: the fast Runner
    against the fast one with int8 weights (`--quantization int8`) / its forward compiled instead;
    a compiled forward's first passes (compile cost) and recompiles are printed."""
    dtype = next(model.parameters()).dtype
    input_ids = torch.randint(16, model.config.get_text_config().vocab_size, (1, prompt_len))
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if fast_decode.unsupported(model):
        raise SystemExit(f"no fast path for this model: {fast_decode.unsupported(model)}")

    def fast_runner():
        runner = Runner(copy.deepcopy(model), family, fast=False)
        runner.fast = fast_decode.FastDecoder(runner.model, input_major)
        return runner

    fast = fast_runner()
    if int8:
        runners = {"fast": fast, "int8": fast_runner()}
        runners["int8"].fast.quantize()
    elif compile_mode:
        runners = {"fast": fast, "compiled": fast_runner()}
        compiled(runners["compiled"].fast, compile_mode)
    else:
        runners = {"today": Runner(model, family, fast=False), "fast": fast}
    old_name, new_name = runners
    states = {name: runner.prefill(inputs)[1] for name, runner in runners.items()}
    if compile_mode:
        first_passes(runners["compiled"], states["compiled"], num_tokens)
    times = {name: [] for name in runners}
    for _ in range(rounds):
        for name, runner in runners.items():
            times[name].append(timed(runner, states[name], 7, steps, num_tokens))
    ratios = [old / new for old, new in zip(times[old_name], times[new_name])]
    weights = weight_bytes(model)
    bandwidth = gemv_bandwidth(dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {str(dtype).removeprefix('torch.')}, "
          f"fast path weights {'(in, out)' if fast.fast.input_major else '(out, in)'}, "
          f"passes over {num_tokens} token(s) after a {prompt_len}-token prompt, {rounds} rounds x {steps} passes")
    print(f"weights read per pass {weights / 1e6:.1f} MB; GEMV 8192^2 here {bandwidth:.1f} GB/s; "
          f"bound {1000 * weights / bandwidth / 1e9:.2f} ms/pass")
    for name, runner in runners.items():
        ms = statistics.median(times[name])
        _, averages = profile_steps(runner, states[name], 7, steps, num_tokens)
        print(f"  {name:>5}: {ms:.3f} ms/pass ({weights / ms / 1e6:.1f} GB/s of the model's weights); "
              f"{split(averages, steps, ms)}")
    print(f"  {new_name} / {old_name} speed ratio: median {statistics.median(ratios):.2f} "
          f"(rounds: {' '.join(f'{r:.2f}' for r in ratios)})")


def first_passes(runner, state, num_tokens: int) -> None:
    """Print the seconds of a compiled forward's first passes (1 token, then `num_tokens`, then
    each again at a longer cache: compile and recompile cost) and the graphs compiled."""
    from torch._dynamo.utils import counters

    for tokens in (1, num_tokens, 1, num_tokens, 1):
        started = time.perf_counter()
        runner.extend(state, [7] * tokens)
        print(f"compiled forward, first passes: {tokens} token(s) at cache length "
              f"{state.cache_len - tokens}: {time.perf_counter() - started:.2f} s")
    runner.rollback(state, 3 + 2 * num_tokens)
    print(f"graphs compiled: {counters['stats']['unique_graphs']}; "
          f"graph breaks: {sum(counters['graph_break'].values())}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.profile_decode", description=__doc__.split("\n\n")[0])
    add_model_flags(parser)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--wrapped", action="store_true", help="full multimodal forward for every step")
    parser.add_argument("--compare", action="store_true", help="today's forward against the fast path")
    parser.add_argument("--shape", help="with --compare: a measure/shapes.py architecture (random weights)")
    parser.add_argument("--layers", type=int, help="with --shape: keep this many decoder layers")
    parser.add_argument("--verify", type=int, default=1, help="with --compare: tokens per pass")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--input-major", choices=("auto", "on", "off"), default="auto",
                        help="with --compare: the fast path's weight layout (auto: (in, out) for 16-bit weights)")
    parser.add_argument("--int8", action="store_true", help="with --compare: the fast path against itself "
                        "with int8 weights (--quantization int8)")
    parser.add_argument("--compile", choices=COMPILE_MODES, help="with --compare: the fast path against itself "
                        "through torch.compile in this mode")
    parser.add_argument("--layouts", action="store_true", help="one product in each weight layout")
    parser.add_argument("--kinds", default="f32,f32-in,bf16,bf16-in", help="with --layouts: weight kinds, of "
                        "f32, f32-in, bf16, bf16-in (in: input-major), int8, torchao, bnb8")
    parser.add_argument("--threads", default="1", help="with --layouts: thread counts, e.g. 1,2")
    args = parser.parse_args(argv)
    if args.layouts:
        with torch.inference_mode():
            layouts(args.kinds.split(","), [int(t) for t in args.threads.split(",")])
        return 0
    if args.compare:
        if args.shape:
            model, family = shape_target(args.shape, args.layers, args.dtype if args.dtype != "fit" else "float32")
        else:
            target = build_engine(replace(spec_from_args(args), drafters=())).target
            model, family = target.model, target.family
        with torch.inference_mode():
            compare(model, family, args.rounds, args.steps, args.verify,
                    {"auto": None, "on": True, "off": False}[args.input_major], int8=args.int8,
                    compile_mode=args.compile)
        return 0
    spec = spec_from_args(args)
    engine = build_engine(replace(spec, drafters=tuple(d for d in spec.drafters if d != "ngram")))
    if args.wrapped:
        for runner in [engine.target.runner] + [d.runner for d in engine.drafters.values() if hasattr(d, "runner")]:
            runner.family = replace(runner.family, direct_text_steps=False)
    messages = request_messages(demo_requests(1)[0])
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
