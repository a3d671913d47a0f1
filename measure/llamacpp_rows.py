"""llama.cpp beside the built-in engine, on the same weights converted to GGUF (models/gguf.py):
an eval row (`python -m measure.eval --backend llamacpp`) and benchmark rows
(`python -m measure.bench --llamacpp`): plain, and with the text drafter as llama.cpp's draft
model. Token ids are compared with the built-in engine's plain answers (float32 for exactness);
each plain row is printed with its bound: bytes of weights read per token over a measured
memory bandwidth.

Conventions: llama-server does not send the stop token, so the built-in engine's final stop
token is left out of the comparison; a speculative llama.cpp answer has no token ids (the server
sends none for drafted tokens), so its text is compared instead.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from engine.ab import first_difference_index
from engine.backend import Request
from engine.backends.llamacpp_process import uses_native
from engine.loop import DecodeSettings, Done
from engine.settings import RequestError
from engine.openmp_pool import release_thread_pool


class Row:
    """Like measure/bench.py's Row: one llama.cpp mode, measured request by request. `text_turns`:
    the requests' text only (llama.cpp drafts on text turns only; images make it refuse);
    `without_pictures`: only the requests that have no image (a GGUF without a vision part),
    the others skipped (`measure` returns None)."""

    def __init__(self, backend, drafter: str | None, label: str | None, text_turns: bool = False,
                 without_pictures: bool = False):
        self.backend, self.drafter, self.label, self.text_turns = backend, drafter, label, text_turns
        self.without_pictures = without_pictures
        self.model_path = backend.paths["model"]  # kept after the backend is closed (Phase.close)
        self.native = backend.server.native  # which llama.cpp: built for this CPU, or the prebuilt wheel
        self.engine, self.mode = "llama.cpp", "speculative" if drafter else "plain"
        self.draft_tree, self.draft_tokens = 0, None
        self.runs = []
        self.error = None

    @property
    def title(self) -> str:
        return f"llama.cpp {self.mode}" + (f" ({self.label})" if self.label else "")

    def measure(self, engine, drafter, messages, decode: DecodeSettings, request_id: int):
        """measure/bench_rows.py's Measurement of one request (with the answer's text as `.text`)."""
        from measure.bench_rows import Measurement

        if self.without_pictures and any(p["type"] == "image" for m in messages for p in m["content"]):
            return None
        if self.text_turns:
            messages = text_only(messages)
        try:
            done = answer(self.backend, messages, self.drafter, decode)
        except Exception as error:  # a crash is a result: the row reports it
            return Measurement(request_id, error=f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")
        s = done.stats
        measurement = Measurement(request_id, done.token_ids, s.ttft_s, s.total_s, s.decode_tok_s, None,
                                  s.drafted, s.accepted)
        measurement.text = done.text
        return measurement


def text_only(messages: list[dict]) -> list[dict]:
    """The messages with their text parts only (llama.cpp drafts on text turns only)."""
    return [{"role": m["role"], "content": [p for p in m["content"] if p["type"] == "text"]} for m in messages]


def start(target: str, draft: str | None, outtype: str = "f32", native: bool | None = None):
    """The llama.cpp backend on `target` (and `draft`), converted once, threads as torch's; `native`:
    which build (engine/backends/llamacpp.py; None: the native one where it has been built)."""
    from engine.backends.llamacpp import LlamaCpp

    return LlamaCpp.from_checkpoint(target, draft=draft, outtype=outtype, threads=torch.get_num_threads(),
                                    cache_prompt=False, native=native)


def start_gguf(path: str, native: bool | None = None):
    """The llama.cpp backend on a GGUF file as it is (text only), threads as torch's."""
    from engine.backends.llamacpp import LlamaCpp

    return LlamaCpp(path, threads=torch.get_num_threads(), cache_prompt=False, native=native)


def answer(backend, messages, drafter: str | None, decode: DecodeSettings) -> Done:
    """The backend's final event for one request, this thread's idle OpenMP pool given back first
    (llama.cpp shares torch's OpenMP runtime: engine/openmp_pool.py, measure/bench.py)."""
    release_thread_pool()
    return [e for e in backend.stream(Request(messages, drafter, decode=decode)) if isinstance(e, Done)][0]


def without_stop(engine, token_ids: list[int]) -> list[int]:
    """The built-in engine's ids as llama-server sends them: no final stop token."""
    return token_ids[:-1] if token_ids and token_ids[-1] in engine.stop_token_ids() else token_ids


def eval_row(engine, backend, questions, plain: list[Done], decode: DecodeSettings) -> dict:
    """measure/eval.py's row for llama.cpp plain: accuracy, and the share of answers whose token
    ids equal the built-in engine's plain answer (`plain`, one per question)."""
    from models.demo.world import answer_matches

    done = [answer(backend, q.messages(), None, decode) for q in questions]
    same = [d.token_ids == without_stop(engine, p.token_ids) for d, p in zip(done, plain)]
    return {"mode": "llama.cpp", "drafter": None,
            "accuracy": sum(answer_matches(d.text, q.answer) for d, q in zip(done, questions)) / len(questions),
            "identical_to_plain": sum(same) / len(questions), "acceptance": None,
            "differing": [q.prompt for q, s in zip(questions, same) if not s]}


class Phase:
    """llama.cpp rows that run together on one server, which is closed before the next phase
    starts: two llama.cpp servers alive in one process (or torch's OpenMP pools beside one) slow
    both down about 6x (engine/openmp_pool.py: 1,400 tok/s on the demo alone, 220 with a second
    server idle beside it), so each figure is taken with only its own server alive."""

    def __init__(self, start_backend, rows: list[tuple[str | None, str | None, bool]], without_pictures: bool = False):
        self.start_backend, self.specs, self.rows = start_backend, rows, []
        self.without_pictures = without_pictures

    def start(self) -> list[Row]:
        backend = self.start_backend()
        self.rows = [Row(backend, drafter, label, text_turns, self.without_pictures)
                     for drafter, label, text_turns in self.specs]
        return self.rows

    def close(self) -> None:
        for backend in {id(r.backend): r.backend for r in self.rows if r.backend is not None}.values():
            backend.close()  # its llama-server processes end
        for row in self.rows:
            row.backend = None


def bench_phases(engine, target: str, outtype: str = "f32", builds: tuple[bool | None, ...] = (None,),
                 original: tuple[str, str] | None = None) -> list[Phase]:
    """llama.cpp plain on the benchmark's requests and on their text alone (a server without a
    draft model); then, with the engine's text drafter (if loaded) as llama.cpp's draft model,
    speculative on their text (llama.cpp drafts on text turns only). `builds`: which llama.cpp
    (True: built for this CPU, False: the prebuilt wheel, None: the first where it has been built),
    each row labelled with its build; the plain phases of all builds first, then the drafting ones.
    `original`: (a GGUF file the target's language model was made from, its type), e.g. the smol
    demo's SmolLM2 Q4_1 file as its package ships it: a plain row on it per build, on the requests
    without a picture (the file has no vision part)."""
    draft = next((d.name for d in engine.drafters.values() if d.kind == "text_lm"), None)
    plain, drafting = [], []
    for native in (uses_native(build) for build in builds):
        suffix = ("" if outtype in ("f32", "bf16") else f", {outtype}") + (", native" if native else ", prebuilt")
        plain.append(Phase(lambda native=native: start(target, None, outtype, native),
                           [(None, suffix.removeprefix(", "), False)]
                           + ([(None, f"text turns{suffix}", True)] if draft else [])))
        if original:
            path, kind = original
            build = "native" if native else "prebuilt"
            plain.append(Phase(lambda native=native: start_gguf(path, native),
                               [(None, f"original {kind} file, requests without a picture, {build}", False)],
                               without_pictures=True))
        if draft:
            drafting.append(Phase(lambda native=native: start(target, draft, outtype, native),
                                  [("text", f"text_drafter, text turns{suffix}", True)]))
    return plain + drafting


def text_plain_row(row: Row, rows: list[Row]) -> Row | None:
    """The plain text-turn row of `row`'s build: what its text is compared with and its speedup taken against."""
    return next((other for other in rows if other.text_turns and other.drafter is None and other.native == row.native),
                None)


def report(table: list[dict], this_plain, rows: list[Row], engine) -> list[str]:
    """Set the llama.cpp rows' `identical_to_plain` in `table` (measure/bench.py's summaries):
    plain rows on the same requests by token ids against this engine's plain row; the text-turn
    rows by text against llama.cpp's plain text-turn row, whose speedups they are given too. Returns
    the lines to print under the table: what was compared, and each plain row's bound."""
    ours = {m.request: without_stop(engine, m.token_ids) for m in this_plain.runs}
    by_title = {r["engine"] + " " + r["mode"] + (f" ({r['drafter']})" if r["drafter"] else ""): r for r in table}
    bandwidth = measured_bandwidth()
    lines = [f"this plain: {bound(weight_bytes(engine.target), bandwidth)}"]
    if engine.target.picture_runner is not None:  # models/picture_weights.py: the GGUF holds the folder's weights
        lines.append("llama.cpp has the text weights only (the folder's; its picture weights are not converted): "
                     "on turns with a picture its answers are the un-adapted model's, so they differ")
    for row in rows:
        summary, runs = by_title[row.title], [m for m in row.runs if m.error is None]
        if not row.text_turns:
            summary["identical_to_plain"] = sum(m.token_ids == ours.get(m.request) for m in runs)
            firsts = {m.request: first_difference_index(m.token_ids, ours.get(m.request, []))
                      for m in runs if m.token_ids != ours.get(m.request)}
            summary["differing"] = [{"request": r, "first_difference": i} for r, i in firsts.items()]
            where = (f" (the differing ones first differ at token {min(firsts.values())}"
                     + (f"-{max(firsts.values())}" if len(firsts) > 1 else "") + ")") if firsts else ""
            lines.append(f"{row.title}: token ids compared with this engine's plain answers (stop token aside)"
                         f"{where}; " + bound(gguf_weight_bytes(row.model_path), bandwidth))
            continue
        plain = {m.request: m for m in text_plain_row(row, rows).runs if m.error is None}
        summary["identical_to_plain"] = sum(m.text == plain[m.request].text for m in runs if m.request in plain)
        summary["differing"] = [m.request for m in runs if m.request in plain and m.text != plain[m.request].text]
        speedups = [m.decode_tok_s / plain[m.request].decode_tok_s for m in runs  # one-token answers: no speed
                    if m.request in plain and m.decode_tok_s and plain[m.request].decode_tok_s]
        if speedups:
            summary["speedup_vs_plain"] = {"min": min(speedups), "median": statistics.median(speedups),
                                           "max": max(speedups)}
        lines.append(f"{row.title}: text compared with, and speedup against, {text_plain_row(row, rows).title}"
                     + ("" if row.drafter else "; " + bound(gguf_weight_bytes(row.model_path), bandwidth)))
    return lines


def realscale_figures(target_dir, drafter_dir, outtype: str, messages, decode: DecodeSettings) -> dict:
    """measure/realscale.py's llama.cpp figures for one preset, on its weights converted to GGUF
    (`outtype`), threads as torch's: plain decoding of the image request with its bound, and on the
    request's text alone plain and with the preset's text drafter as llama.cpp's draft model (it
    refuses to draft on images). One server alive at a time (Phase); the caller frees its own
    engine first (memory: a 3B model and its GGUF side by side need both)."""
    import gc

    release_thread_pool()  # this engine's idle OpenMP pool would slow llama.cpp's (measure/bench.py says why)
    text_turn = text_only(messages)
    backend = start(str(target_dir), None, outtype)
    model_path, build = backend.paths["model"], backend.server.kind
    answer(backend, text_turn, None, replace(decode, max_new_tokens=2))  # warm-up: pages the weights in
    text_plain = answer(backend, text_turn, None, decode)
    try:
        plain, image_error = answer(backend, messages, None, decode), None
    except RequestError as error:  # llama.cpp's processor refuses some random-weight shapes' images ("Invalid token")
        plain, image_error = None, str(error)
    del backend
    gc.collect()
    drafting = start(str(target_dir), str(drafter_dir), outtype)
    text_draft = answer(drafting, text_turn, "text", decode)
    threads = drafting.threads
    del drafting
    gc.collect()
    bandwidth = measured_bandwidth()
    theirs = gguf_weight_bytes(model_path)
    return {"outtype": outtype, "build": build, "bandwidth_gb_s": bandwidth, "threads": threads,
            "plain_tok_s": plain and plain.stats.decode_tok_s, "image_error": image_error,
            "text_plain_tok_s": text_plain.stats.decode_tok_s, "text_draft_tok_s": text_draft.stats.decode_tok_s,
            "text_drafted": text_draft.stats.drafted, "text_accepted": text_draft.stats.accepted,
            "weights_bytes": theirs, "bound_tok_s": bandwidth * 1e9 / theirs}


def weight_bytes(target) -> int:
    """Bytes of the weights a decode step of this engine uses: the language model's parameters and
    its output layer (not the vision tower and connector: they run at prefill only), each product
    that the fast path reads quantized (`--quantization int8|w8a8|q4_0`: engine/quantized.py,
    Int8Weight, W8A8Weight, Q4Weight) counted at its stored size (values or codes, scales, sums), and
    each it reads from GGUF blocks (engine/packed.py, PackedWeight) at the blocks' size.
    Like gguf_weight_bytes, the whole embedding counts (a step reads one row of it: bytes_read)."""
    from engine.packed import PackedWeight
    from engine.quantized import Int8Weight, Q4Weight

    decoder = list(target.model.get_decoder().parameters())  # the vision tower and connector run at prefill only
    output = target.model.get_output_embeddings().weight
    tied = any(p.data_ptr() == output.data_ptr() for p in decoder)
    total = sum(p.numel() * p.element_size() for p in decoder + ([] if tied else [output]))
    fast = target.runner.fast
    if fast is None:
        return total
    size = target.model.get_input_embeddings().weight.element_size()  # the unquantized weights' bytes a value
    products = [w for layer in fast.stack.layers for w in vars(layer).values()] + [fast.head_weight]
    quantized = [w for w in products if isinstance(w, (Int8Weight, Q4Weight))]
    unquantized = sum(len(w.values) * w.values.shape[1] if isinstance(w, Int8Weight) else len(w.codes) * w.width
                      for w in quantized) * size
    stored = sum(t.numel() * t.element_size() for w in quantized for t in vars(w).values()
                 if isinstance(t, torch.Tensor))
    blocks = [w for w in products if isinstance(w, PackedWeight)]
    unpacked = sum(w.weight.numel() * w.weight.element_size() for w in blocks)
    return total - unquantized + stored - unpacked + sum(w.nbytes for w in blocks)


def bytes_read(target) -> int:
    """Bytes of weights a decode step of this engine reads: weight_bytes without the input
    embedding's other rows when the output layer is a matrix of its own (a step looks up one row)."""
    embedding = target.model.get_input_embeddings().weight
    output = target.model.get_output_embeddings().weight
    total = weight_bytes(target)
    if embedding.data_ptr() == output.data_ptr():  # tied: the output layer reads the whole table
        return total
    return total - (len(embedding) - 1) * embedding[0].numel() * embedding.element_size()


def bound(weights: int, bandwidth: float) -> str:
    """Bytes of weights read per token over the memory bandwidth (GB/s): the most tokens/s plain
    decoding can reach (weights that fit in the caches can beat it)."""
    return (f"bound: {weights / 1e6:.1f} MB of weights per token / {bandwidth:.1f} GB/s "
            f"= {bandwidth * 1e9 / weights:.0f} tok/s")


def gguf_weight_bytes(path) -> int:
    """The bytes of a GGUF file's tensors (all are read for each token, the embedding's one row aside)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


def measured_bandwidth(size: int = 4096, repeats: int = 9) -> float:
    """GB/s of a float32 matrix-vector product of size x size (64 MB, beyond the caches): the
    memory bandwidth plain decoding sees, measured the way issue 28 did (median of repeats)."""
    matrix, vector = torch.randn(size, size), torch.randn(size)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mv(matrix, vector)
        times.append(time.perf_counter() - started)
    return matrix.numel() * matrix.element_size() / statistics.median(times[1:]) / 1e9
