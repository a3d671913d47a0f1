"""Speed at real model sizes, offline: real architectures with random weights (measure/shapes.py,
built once and cached under ~/.cache/vlm-spec-bench), one image request, greedy.

    python -m measure.realscale [--preset qwen2.5-vl-3b] [--preset smolvlm-256m] [--dtype bfloat16]
                                [--device cpu|cuda] [--max-new-tokens 32] [--image-size 224]
                                [--llamacpp [f32|bf16|q8_0]] [--int8 | --quantization int8|w8a8|q4_0]
                                [--quick] [--json FILE]

Per preset (each measured in a process of its own, so its peak memory is its own):
- t(n): a target pass over n = 1..9 tokens after the prompt (median), and t(n) / t(1);
- the preset's text drafter's step (its real shape: Qwen2.5-0.5B, SmolLM2-135M), in the dtype
  `--drafter-dtype auto` gives it;
- prefill, and the vision tower (`get_image_features`) alone, timed apart;
- plain decoding, this engine against transformers' `generate()`;
- a replay drafter (measure/replay.py: the target's own greedy answer, each position corrupted
  at 1 - acceptance) at acceptance 1.0 / 0.8 / 0.6 / 0.2, with k fixed at 4 and k chosen from
  cost: decode speedup over plain, and the cost-model bound for the rounds it ran (tokens per
  target pass x t(1) / mean of t(k+1) over its rounds; a replay draft step costs nothing), and
  efficiency = speedup / bound;
- peak resident memory of the process when the row's figures are done (with llama.cpp, also
  the whole process's).
With random weights in bfloat16 a verify pass can flip a near-tie argmax, so the replayed
answer is the one the engine itself gives with the replay drafter (a fixed point, measure/replay.py).

`--int8` (or `--quantization int8|w8a8|q4_0`) then quantizes the target in place as that
`--quantization` does at load (the fast path's decode and verify passes read the quantized copies;
prefill keeps the loaded weights) and measures the rows again from t(n) on, on an engine whose pass
costs were forgotten: k from cost is chosen from the quantized passes. `--llamacpp` runs llama.cpp
last, after this engine is freed, one server at a time: beside the unquantized rows on the target's
dtype (or the GGUF type asked), beside the quantized rows on Q8_0 (int8, w8a8) or Q4_0 (q4_0).
`--quick` uses the shrunken shapes (seconds; CI runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace

import torch

ACCEPTANCES = (1.0, 0.8, 0.6, 0.2)
FIXED_K = 4
QUANTIZED_GGUF = {"int8": "q8_0", "w8a8": "q8_0", "q4_0": "q4_0"}  # --quantization: llama.cpp's GGUF beside it
UNQUANTIZED_GGUF = {"bfloat16": "bf16", "float32": "f32"}  # --dtype: llama.cpp's GGUF of the same
REPEATS = 3  # timings of t(n), the draft step and the prefill: medians of this many


def photo(size: int):
    """The repository's rocket photo, resized to size x size."""
    from PIL import Image

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return Image.open(os.path.join(root, "assets", "examples", "rocket.jpg")).convert("RGB").resize((size, size))


def measure(preset: str, quick: bool, dtype: str, device: str, max_new_tokens: int, image_size: int,
            acceptances: tuple[float, ...] = ACCEPTANCES, llamacpp: str | None = None,
            quantization: str | None = None) -> dict:
    """One preset's figures: this engine's rows on the target as loaded (`our_rows`), its prefill
    and transformers' generate(); with `quantization` (int8, w8a8, q4_0), the rows again after the
    target is quantized in place as that `--quantization` does at load (`out["int8"]`, the key kept
    for every kind, its kind in `out["int8"]["quantization"]`); then, this engine freed, llama.cpp's
    figures (`llamacpp`: beside the first rows in the target's dtype or the one asked, beside the
    quantized rows in QUANTIZED_GGUF's type), one server at a time."""
    from engine.drafters.registry import load_drafter
    from engine.engine import Engine
    from engine.loop import DecodeSettings
    from engine.target import load_target, quantize_fast
    from measure.bench_rows import run_transformers
    from measure.shapes import build_preset
    from models.loading import LoadOptions, dtype_name

    target_dir, drafter_dir = build_preset(preset, quick)
    options = LoadOptions(dtype=dtype, device=device)
    target = load_target(str(target_dir), options)
    engine = Engine(target, {"text": load_drafter(str(drafter_dir), target, options)})
    messages = [{"role": "user", "content": [{"type": "image", "image": photo(image_size)},
                                             {"type": "text", "text": "Describe this image in detail."}]}]
    prompt = engine.prepare(messages)
    decode = DecodeSettings(max_new_tokens=max_new_tokens, stop_token_ids=frozenset({-1}))  # never stops early
    out = {"preset": preset, "quick": quick, "dtype": dtype, "device": str(target.runner.device),
           "target_parameters": _parameters(target.model), "prompt_tokens": len(prompt.input_ids),
           "image_tokens": prompt.num_image_tokens,
           "drafter_parameters": _parameters(engine.drafters["text"].runner.model),
           "drafter_dtype": dtype_name(engine.drafters["text"].runner.model)}
    out |= our_rows(engine, messages, decode, acceptances, text_turn=bool(llamacpp))
    out["prefill"] = prefill_split(engine, prompt, REPEATS)
    generate = run_transformers(engine, None, messages, decode, 1)
    out["generate_tok_s"], out["plain_equals_generate"] = generate.decode_tok_s, out["answer"] == generate.token_ids
    out["peak_memory_gb"] = _peak_memory_gb()
    if quantization:
        quantize_fast(target.runner, str(target_dir), quantization)  # decode and verify passes read these from here on
        out["int8"] = our_rows(engine, messages, decode, acceptances, text_turn=bool(llamacpp))
        out["int8"]["quantization"] = quantization
        out["int8"]["peak_memory_gb"] = _peak_memory_gb()
        out["int8"]["tokens_as_unquantized"] = next(
            (i for i, (a, b) in enumerate(zip(out["answer"], out["int8"]["answer"])) if a != b), len(out["answer"]))
    if torch.cuda.is_available() and device != "cpu":
        out["peak_cuda_memory_gb"] = torch.cuda.max_memory_allocated() / 2 ** 30
    del engine, target, generate  # llama.cpp's turn: this engine's memory given back first
    _collect_engines()
    if llamacpp:
        from measure.llamacpp_rows import realscale_figures

        outtype = UNQUANTIZED_GGUF[dtype] if llamacpp == "same" else llamacpp
        out["llamacpp"] = realscale_figures(target_dir, drafter_dir, outtype, messages, decode)
        if quantization:
            theirs = QUANTIZED_GGUF[quantization]
            out["int8"]["llamacpp"] = out["llamacpp"] if outtype == theirs else \
                realscale_figures(target_dir, drafter_dir, theirs, messages, decode)
        out["process_peak_memory_gb"] = _peak_memory_gb()
    return out


def our_rows(engine, messages, decode, acceptances: tuple[float, ...], text_turn: bool) -> dict:
    """This engine's figures on its target's weights as they are now: t(n) and the text drafter's
    step (measure/bench_rows.py cost_model), plain decoding, the replay drafter at each acceptance
    with k = FIXED_K and k from cost, the text drafter, and (text_turn) plain decoding of the
    request's text alone. The engine's pass costs are forgotten after the warm-up, so the cost rule
    prices these weights' passes only, never those of rows measured before on other weights."""
    from measure.bench_rows import cost_model, run_this
    from measure.llamacpp_rows import text_only, weight_bytes
    from measure.replay import ReplayDrafter, record_fixed_point

    target = engine.target
    run_this(engine, None, messages, replace(decode, max_new_tokens=2), 0)  # warm-up: pages the weights in
    engine.costs.reset()
    costs = cost_model(engine, messages, FIXED_K, repeats=REPEATS, max_tokens=9)
    t = costs["t_s"]
    out = {"weights_bytes": weight_bytes(target), "t_s": t, "t_ratio": {n: t[n] / t[1] for n in t},
           "draft_step_s": costs["draft_step_s"]["text"]}
    plain = run_this(engine, None, messages, decode, 1)
    out["plain_tok_s"], out["answer"] = plain.decode_tok_s, plain.token_ids

    def replay_run(recording, acceptance, k):
        engine.drafters["replay"] = ReplayDrafter(recording, acceptance, target.vocab_size, target.placeholder_ids)
        return run_this(engine, "replay", messages, replace(decode, draft_tokens=k), 2)

    recording = record_fixed_point(lambda rec: replay_run(rec, 1.0, FIXED_K).token_ids, plain.token_ids)
    out["replay_answer_is_plain"] = recording == plain.token_ids
    out["replay"] = []
    for acceptance in acceptances:
        for k in (FIXED_K, None):
            m = replay_run(recording, acceptance, k)
            rounds = m.draft_lengths or [0]
            bound = _tokens_per_pass(m) * t[1] / statistics.mean(t[min(n + 1, 9)] for n in rounds)
            speedup = m.decode_tok_s / plain.decode_tok_s
            out["replay"].append({"acceptance": acceptance, "k": "cost" if k is None else k,
                                  "mean_k": statistics.mean(rounds), "speedup": speedup, "bound": bound,
                                  "efficiency": speedup / bound, "measured_acceptance": _acceptance(m),
                                  "decode_tok_s": m.decode_tok_s, "equals_plain": m.token_ids == plain.token_ids})
    del engine.drafters["replay"]
    text = run_this(engine, "text", messages, decode, 3)
    out["text_drafter"] = {"decode_tok_s": text.decode_tok_s, "speedup": text.decode_tok_s / plain.decode_tok_s,
                           "acceptance": _acceptance(text), "mean_k": statistics.mean(text.draft_lengths or [0]),
                           "equals_plain": text.token_ids == plain.token_ids}
    if text_turn:  # beside llama.cpp's text turn (its draft model refuses images)
        out["text_plain_tok_s"] = run_this(engine, None, text_only(messages), decode, 4).decode_tok_s
    return out


def _collect_engines() -> None:
    """Free dropped engines now. A worker thread holds its engine until the thread returns, a
    moment after the last answer's final event (engine/worker.py), so wait for those first."""
    import gc
    import threading

    for thread in threading.enumerate():
        if thread.name == "engine-worker":
            thread.join()
    gc.collect()


def _peak_memory_gb() -> float:
    """This process's peak resident memory so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def prefill_split(engine, prompt, repeats: int) -> dict:
    """Median seconds of the whole prefill and of the vision tower alone (same inputs). They are two
    separate timings: on tiny shapes the vision tower alone can measure longer than the whole."""
    from engine.stats import Clock
    from measure.bench_rows import median_seconds

    runner = engine.target.runner
    clock = Clock(runner.device)
    inputs = {name: value.to(runner.device) for name, value in prompt.target_inputs.items()}
    vision_inputs = {name: inputs[name] for name in ("image_grid_thw", "pixel_attention_mask") if name in inputs}

    with torch.inference_mode():
        vision = median_seconds(lambda: engine.target.model.model.get_image_features(inputs["pixel_values"],
                                                                                     **vision_inputs), clock, repeats)
    whole = median_seconds(lambda: runner.prefill(prompt.target_inputs), clock, repeats)
    return {"total_s": whole, "vision_s": vision}


def _parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _tokens_per_pass(m) -> float:
    return (len(m.token_ids) - 1) / max(1, len(m.draft_lengths))


def _acceptance(m) -> float | None:
    """Per-token acceptance: accepted / (accepted + rounds that rejected a token)."""
    judged = m.accepted + m.rejected_rounds
    return m.accepted / judged if judged else None


def table_rows(results: list[dict]) -> list[dict]:
    """One row per preset and weights: as loaded, then with int8 weights where measured (the
    preset's other figures, its prefill among them, are the unquantized weights'; generate() ran on
    those only)."""
    rows = []
    for r in results:
        rows.append(r)
        if "int8" in r:
            kind = r["int8"].get("quantization", "int8")  # runs before --quantization had int8 only
            rows.append({k: v for k, v in r.items() if k not in ("int8", "llamacpp")} | r["int8"]
                        | {"dtype": f"{r['dtype']} + {kind} weights", "generate_tok_s": None})
    return rows


def print_table(results: list[dict]) -> None:
    print("| preset | parameters (target / drafter) | dtype | t(1) | t(n)/t(1), n = 2 / 3 / 5 / 9 | draft step "
          "| prefill (vision tower alone) | plain vs generate() | replay k=4 "
          "| replay, k from cost | peak memory |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = table_rows(results)
    for r in rows:
        t, ratio = r["t_s"], r["t_ratio"]
        fixed = [x for x in r["replay"] if x["k"] == FIXED_K]
        cost = [x for x in r["replay"] if x["k"] == "cost"]
        fmt = lambda rows: " / ".join(f"{x['speedup']:.2f}x ({x['efficiency']:.2f})" for x in rows)  # noqa: E731
        rates = " / ".join(format(x["acceptance"], ".1f") for x in fixed)
        generate = "-" if r["generate_tok_s"] is None else format(r["generate_tok_s"], ".2f")
        print(f"| {r['preset']}{' (quick)' if r['quick'] else ''} | {r['target_parameters'] / 1e9:.2f} B / "
              f"{r['drafter_parameters'] / 1e9:.3f} B | {r['dtype']} (drafter {r['drafter_dtype']}) "
              f"| {t[1] * 1000:.0f} ms | {' / '.join(f'{ratio[n]:.2f}' for n in (2, 3, 5, 9))} "
              f"| {r['draft_step_s'] * 1000:.0f} ms ({r['draft_step_s'] / t[1]:.2f} t(1)) "
              f"| {r['prefill']['total_s']:.2f} s ({r['prefill']['vision_s']:.2f} s; {r['image_tokens']} image "
              f"tokens of {r['prompt_tokens']}) | {r['plain_tok_s']:.2f} vs {generate} tok/s "
              f"| a = {rates}: {fmt(fixed)} | {fmt(cost)} (mean k {' / '.join(format(x['mean_k'], '.1f') for x in cost)}) "
              f"| {r['peak_memory_gb']:.1f} GB |")
    print("replay cells: decode speedup over plain (efficiency = speedup / cost-model bound); peak memory: the "
          "process's when the row's figures were done (int8 rows: with the unquantized weights still held)")
    beside = [r for r in rows if "llamacpp" in r]
    if beside:
        print("\n| preset: this engine's weights / llama.cpp's | plain, text turn: this engine / llama.cpp (bounds) "
              "| this / llama.cpp | plain, image turn: this engine / llama.cpp "
              "| replay a = 0.8, k from cost / llama.cpp plain | text drafter (acceptance) / llama.cpp plain "
              "| llama.cpp, text turn with the text drafter (accepted of drafted) |")
        print("|---|---|---|---|---|---|---|")
    for r in beside:
        ll, replay = r["llamacpp"], next((x for x in r["replay"] if x["k"] == "cost" and x["acceptance"] == 0.8), None)
        drafted, base = r["text_drafter"], ll["plain_tok_s"] or ll["text_plain_tok_s"]  # image turn where it ran
        acceptance = "-" if drafted["acceptance"] is None else f"{drafted['acceptance']:.2f}"
        image = f"{ll['plain_tok_s']:.2f}" if ll["plain_tok_s"] else f"failed ({ll['image_error']})"
        our_bound = ll["bandwidth_gb_s"] * 1e9 / r["weights_bytes"]
        print(f"| {r['preset']}: {r['dtype']} / {ll['outtype']} ({ll['threads']} threads) "
              f"| {r['text_plain_tok_s']:.2f} / {ll['text_plain_tok_s']:.2f} tok/s ({our_bound:.1f} / "
              f"{ll['bound_tok_s']:.1f} at {ll['bandwidth_gb_s']:.1f} GB/s) "
              f"| {_ratio(r['text_plain_tok_s'], ll['text_plain_tok_s'])} "
              f"| {r['plain_tok_s']:.2f} / {image} "
              f"| {_ratio(replay and replay['decode_tok_s'], base)} "
              f"| {_ratio(drafted['decode_tok_s'], base)} ({acceptance}) "
              f"| {ll['text_draft_tok_s']:.2f} tok/s ({ll['text_accepted']} of {ll['text_drafted']}) |")
    if beside:
        print("bounds: weights read per token / the bandwidth of a float32 matrix-vector product, measured "
              "after that row's llama.cpp figures (it moves from run to run); peak memory with llama.cpp: "
              + ", ".join(f"{r['preset']} {r['process_peak_memory_gb']:.1f} GB" for r in results
                          if "process_peak_memory_gb" in r))


def _ratio(a: float | None, b: float | None) -> str:
    """a / b as "1.23x", or "-" where either is unknown or b is 0 (an answer of one token has no speed)."""
    return f"{a / b:.2f}x" if a and b else "-"


def main(argv=None) -> int:
    from transformers.utils import logging as hf_logging

    parser = argparse.ArgumentParser(prog="python -m measure.realscale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", action="append", choices=["qwen2.5-vl-3b", "smolvlm-256m", "qwen2.5-vl-7b"],
                        help="repeatable (default: smolvlm-256m and qwen2.5-vl-3b)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224, help="the photo's side in pixels (default 224)")
    parser.add_argument("--acceptances", default=",".join(map(str, ACCEPTANCES)),
                        help="replay acceptances, comma-separated (default 1.0,0.8,0.6,0.2)")
    parser.add_argument("--quick", action="store_true", help="shrunken shapes (2 layers, hidden 64): seconds")
    parser.add_argument("--llamacpp", nargs="?", const="same", choices=["same", "f32", "bf16", "q8_0"],
                        help="also llama.cpp on the same weights converted to GGUF (models/gguf.py): the "
                             "target's dtype (default), or f32, bf16, q8_0; int8 rows beside Q8_0")
    parser.add_argument("--int8", action="store_true",
                        help="also the rows with int8 weights (--quantization int8), after the others")
    parser.add_argument("--quantization", choices=sorted(QUANTIZED_GGUF),
                        help="also the rows with these weights (as --quantization at load), after the others; "
                             "llama.cpp beside them on Q8_0 (int8, w8a8) or Q4_0 (q4_0)")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process: one preset
    args = parser.parse_args(argv)
    args.quantization = args.quantization or ("int8" if args.int8 else None)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(min(torch.get_num_threads(), os.cpu_count() or 1))
    presets = args.preset or ["smolvlm-256m", "qwen2.5-vl-3b"]
    results = []
    for preset in presets:
        if args.quick or args.one:
            results.append(measure(preset, args.quick, args.dtype, args.device, args.max_new_tokens, args.image_size,
                                   tuple(float(a) for a in args.acceptances.split(",")), args.llamacpp, args.quantization))
        else:
            results.append(_in_child(preset, args))
        print(f"{preset} measured", file=sys.stderr)
    if args.one:
        json.dump(results[0], sys.stdout)
        return 0
    print_table(results)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"command": "python -m measure.realscale " + " ".join(argv or sys.argv[1:]),
                       "threads": torch.get_num_threads(), "results": results}, file, indent=1)
    return 0


def _in_child(preset: str, args) -> dict:
    """Build the preset (a child of its own: building holds a second copy of the weights), then
    measure it in another, so that each figure of peak memory is the measurement's alone."""
    from measure.shapes import build_preset

    subprocess.run([sys.executable, "-c", f"from measure.shapes import build_preset; build_preset({preset!r})"],
                   check=True)
    build_preset(preset)  # already built: returns the folders
    command = [sys.executable, "-m", "measure.realscale", "--one", "--preset", preset, "--dtype", args.dtype,
               "--device", args.device, "--max-new-tokens", str(args.max_new_tokens),
               "--image-size", str(args.image_size), "--acceptances", args.acceptances] + (
                   ["--llamacpp", args.llamacpp] if args.llamacpp else []) + (
                   ["--quantization", args.quantization] if args.quantization else [])
    with tempfile.TemporaryFile("w+") as out:
        subprocess.run(command, check=True, stdout=out)
        out.seek(0)
        return json.loads(out.read(), object_hook=_int_keys)


def _int_keys(d: dict) -> dict:
    return {int(k) if k.isdigit() else k: v for k, v in d.items()}


if __name__ == "__main__":
    sys.exit(main())
