"""llama.cpp on this machine behind the backend interface: llama-server in a child process
(engine/backends/llamacpp_process.py: llama.cpp built for this CPU when it has been built with
`python -m engine.backends.llamacpp_native`, else the xllamacpp wheel's server) on GGUF files made by
models/gguf.py.

    backend = LlamaCpp.from_checkpoint("assets/demo/target", draft="assets/demo/text_drafter")
    for event in backend.stream(request):   # request: engine/backend.py's Request (or any object with its fields)
        ...  # engine/loop.py Chunk events, then one Done, each with a Stats snapshot

Requests go through the child's `handle_chat_completions` (llama-server's /v1/chat/completions):
OpenAI-style messages, images as `image_url` parts with PNG data URLs; streamed, each chunk to a
callback on a thread of this module, which hands it to the caller through a queue; the
callback's return value stops the server (set `request.stop`, or close the stream). A child that
died fails its answer with a message saying so and is started again for the next one.

Prompts. llama-server flattens a message that holds images to one string before the chat template
sees it (common/chat.cpp `to_json_oaicompat`): text parts joined with "\n", an image as a media
marker. A template that labels images ("Picture 1: " in Qwen2-VL's `add_vision_id`, on by
default in the demo model) never sees an image part. So `openai_content` merges adjacent text
parts (the checkpoint's template concatenates them) and, when the model's template labels images
by default, writes the label as text before each image: the prompt is then the one the built-in
engine renders.

Statistics: `ttft_s`, `decode_tok_s` and token counts from the stream on this machine (one token
per chunk; its id from `logprobs` with `post_sampling_probs`, which costs no extra pass; while
drafting llama-server sends the first token's only, so a speculative answer's `Done.token_ids` is
empty: compare its text);
`prefill_s` and `prefill_tokens` from the response's `timings` (`prompt_ms`, `prompt_n` +
`cache_n`); drafted / accepted from `timings.draft_n` / `draft_n_accepted` (tools/server/
server-common.cpp `server_slot_stats::to_json`, omitted when nothing was drafted). llama.cpp does
not say which tokens were accepted drafts, nor its target passes: those stay unknown.

Images: shrunk to what the model takes before they are sent (`image_fit`, the options the app's
decoder, engine/image_jail.py `ImageJail.load`, shrinks them with as it decodes): from a checkpoint, the
size its processor resizes to under a budget of `max_image_tokens` tokens (CPU_IMAGE_TOKENS, as the
built-in engine on a CPU: the built-in engine's pixels, and far under llama.cpp's batch of 2,048:
in issue 39 a full-size photo, sent whole, came to 4,112 image tokens and was refused after 93 s
and 5.6 GB); from GGUF
files alone, MAX_SIDE pixels on the longest side. An image given at full size (`stream` called
directly) is shrunk the same way; PNG always (`lossless`), never at more than that size.

Speculative decoding: with a draft model, llama.cpp drafts on text turns; on a turn with images it
refuses ("failed to process speculative batch": the target's image embeddings do not fit the
draft's input width). That turn is answered again by a plain server (started on first need) and
its statistics name the fallback (`Stats.fallback_reason`), as the built-in engine's do.
"""

from __future__ import annotations

import copy
import json
import queue
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from engine.backend import Capabilities, stream_timed
from engine.backends.llamacpp_process import ServerFiles, ServerProcess
from engine.backends.messages import LongestSide, labels_images, openai_content
from engine.engine import RequestError
from engine.load_settings import CPU_IMAGE_TOKENS
from engine.prompt import Prompt, normalize
from engine.loop import Chunk, Done
from engine.stats import Stats

DRAFTER = "text"  # the name Request.drafter takes for the draft model
DRAFTER_KIND = "text_lm"  # what llama.cpp's draft model is: a language model that reads the tokens, not the images
IMAGE_REFUSAL = "failed to process speculative batch"
FALLBACK = ("llama.cpp cannot draft on a turn with images (failed to process speculative batch): "
            "decoded plainly")
FINISH_REASONS = {"stop": "stop_token", "length": "max_new_tokens"}
MEASURED = frozenset({"mode", "drafter", "drafter_kind", "prefill_tokens", "prefill_s", "prepare_s",
                      "ttft_s", "decode_tokens", "decode_s", "decode_tok_s", "total_s", "new_tokens", "drafted",
                      "accepted", "acceptance", "fallback_reason", "finish_reason", "tok_s_curve",
                      "draft_shape"})  # "chain": draft-simple drafts one token a step (common/speculative.cpp)
_END = object()


class LlamaCpp:
    """A llama-server in this process: `model` (GGUF), `mmproj` (its vision projector, for images),
    `draft` (a GGUF draft model for llama.cpp's speculative decoding on text turns)."""

    def __init__(self, model: str | Path, mmproj: str | Path | None = None, draft: str | Path | None = None,
                 threads: int = 2, context: int = 4096, cache_prompt: bool = True, checkpoint: str | Path | None = None,
                 max_image_tokens: int = CPU_IMAGE_TOKENS, native: bool | None = None):
        """`checkpoint`: the folder the GGUF files were converted from (its processor sizes images);
        `native`: True, llama.cpp built for this CPU; False, the xllamacpp wheel's server; None, the
        first where it has been built (engine/backends/llamacpp_process.py `uses_native`)."""
        self.native = native
        self.paths = {"model": Path(model), "mmproj": mmproj and Path(mmproj), "draft": draft and Path(draft)}
        self.threads, self.context, self.cache_prompt = threads, context, cache_prompt
        self.fit = _image_fit(checkpoint, max_image_tokens) if mmproj else {}
        self.server = self._start(draft=self.paths["draft"])
        self.plain_server = None if self.paths["draft"] else self.server  # for image turns, started on need
        self.label_images = labels_images(self._props().get("chat_template", ""))
        self.name = "llama.cpp"
        self.checkpoint = checkpoint and Path(checkpoint)  # the checkpoint folder it was converted from, if any

    @classmethod
    def from_checkpoint(cls, target: str | Path, draft: str | Path | None = None, outtype: str = "f32",
                        **options) -> LlamaCpp:
        """Convert (once, cached: models/gguf.py) a checkpoint folder and its draft model, and start.
        outtype q4_0 / q4_k_m (llama-quantize's, llamacpp_native.py): the vision projector in q8_0."""
        from engine.backends.llamacpp_native import QUANTIZED, quantized_gguf
        from models.gguf import converted

        def language_model(src):
            return quantized_gguf(src, outtype) if outtype in QUANTIZED else converted(src, outtype)

        mmproj_type = "q8_0" if outtype in ("q4_0", *QUANTIZED) else outtype
        mmproj = converted(target, mmproj_type, mmproj=True) if _has_vision(target) else None
        return cls(language_model(target), mmproj, language_model(draft) if draft else None,
                   checkpoint=target, **options)

    @classmethod
    def open(cls, location: str | None = None, **options) -> LlamaCpp:
        """The app's `--backend llamacpp[:LOCATION]`: None, the bundled demo model with its text
        drafter as the draft model; a checkpoint folder (config.json), converted on first use; a
        .gguf file (text only); or a folder of GGUF files: one model and, for images, one
        `mmproj*.gguf`. ValueError (one line) when LOCATION is none of these."""
        if location is None:
            from models.presets import ASSETS, DEMO_MODEL

            return cls.from_checkpoint(DEMO_MODEL, draft=Path(ASSETS) / "text_drafter", **options)
        path = Path(location).expanduser()
        if (path / "config.json").is_file():
            return cls.from_checkpoint(path, **options)
        if path.is_file():
            if path.suffix != ".gguf":
                raise ValueError("not a .gguf file, a checkpoint folder or a folder of GGUF files")
            return cls(path, **options)
        if not path.is_dir():
            raise ValueError("no such file or folder")
        files = sorted(path.glob("*.gguf"))
        projectors = [f for f in files if f.name.startswith("mmproj")]
        models = [f for f in files if f not in projectors]
        if len(models) != 1 or len(projectors) > 1:
            raise ValueError(f"a folder needs a config.json (a checkpoint), or one model .gguf and at "
                             f"most one mmproj*.gguf; it has {', '.join(f.name for f in files) or 'neither'}")
        return cls(models[0], projectors[0] if projectors else None, **options)

    def image_fit(self) -> dict:
        """engine/images.py load_image's options: images shrunk, as they are decoded, to what is sent."""
        return self.fit

    @property
    def url(self) -> str:
        """The server's own HTTP address (llama-server's routes, /v1/chat/completions included)."""
        return self.server.listening_address

    @property
    def capabilities(self):
        drafters = (DRAFTER,) if self.paths["draft"] else ()
        return Capabilities(self.name, images=self.paths["mmproj"] is not None, speculative=bool(drafters),
                            token_ids=True, drafters=drafters, drafter_kinds=(DRAFTER_KIND,) * len(drafters),
                            default_drafter=drafters[0] if drafters else None,
                            statistics=MEASURED)

    def stream(self, request) -> Iterator[Chunk | Done]:
        """Answer `request` (messages, drafter, sampling, decode, stop, started: engine/backend.py's Request)."""
        started = time.perf_counter() if request.started is None else request.started
        if request.drafter not in (None, DRAFTER) or (request.drafter and not self.paths["draft"]):
            raise RequestError(f"drafter {request.drafter!r}: llama.cpp here has "
                               + (f"one draft model, {DRAFTER!r}" if self.paths["draft"] else "no draft model"))
        if isinstance(request.messages, Prompt):
            raise RequestError("llama.cpp takes messages, not a prepared Prompt")
        messages = normalize(request.messages)
        if not self.paths["mmproj"] and any(p["type"] == "image" for m in messages for p in m["content"]):
            raise RequestError("this llama.cpp model has no vision projector (mmproj): send text only")
        # No lock: the server has one slot and queues a request until the one before it ends,
        # which happens at its next chunk once its consumer has gone.
        yield from _Answer(self, self._body(messages, request), request, started, request.drafter is not None).run()

    def _body(self, messages: list[dict], request) -> dict:
        sampling, decode = request.sampling, request.decode
        counter = iter(range(1, 10**6))  # images are numbered across the conversation, as templates do
        messages = [{"role": m["role"], "content": openai_content(m["content"], self.label_images, counter, self.fit,
                                                                  lossless=True)}
                    for m in messages]
        body = {"messages": messages, "stream": True, "max_tokens": decode.max_new_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                "cache_prompt": self.cache_prompt, "logprobs": True, "top_logprobs": 1, "post_sampling_probs": True}
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if decode.stop_token_ids and all(t < 0 for t in decode.stop_token_ids):
            body["ignore_eos"] = True  # stop tokens that no token is (measure/realscale.py): never stop early
        return body

    def _start(self, draft: Path | None) -> ServerProcess:
        files = ServerFiles(str(self.paths["model"]), self.paths["mmproj"] and str(self.paths["mmproj"]),
                            draft and str(draft))
        return ServerProcess(files, self.threads, self.context, self.native)

    def close(self) -> None:
        """End the child servers (they also end with this process)."""
        for server in {id(s): s for s in (self.server, self.plain_server) if s is not None}.values():
            server.close()

    def _props(self) -> dict:
        """llama-server's /props (its chat template among them): read in milliseconds, where
        parsing the GGUF file's metadata in Python takes seconds."""
        with urllib.request.urlopen(self.url + "/props", timeout=60) as response:
            return json.load(response)

    def plain(self):
        """The server without the draft model (image turns when a draft model is set)."""
        if self.plain_server is None:
            self.plain_server = self._start(draft=None)
        return self.plain_server


class _Answer:
    """One request's run: the server's callback pushes chunks into a queue; `run` turns them into
    events. The server runs on a thread of its own so that the consumer can stop it between chunks."""

    def __init__(self, backend: LlamaCpp, body: dict, request, started: float, speculative: bool):
        self.backend, self.body, self.request, self.started = backend, body, request, started
        self.speculative = speculative
        self.stats = Stats(mode="speculative" if speculative else "plain", drafter=DRAFTER if speculative else None,
                           drafter_kind=DRAFTER_KIND if speculative else None)
        self.stats.unknown = tuple(name for name in _field_names() if name not in MEASURED | {"unknown"})
        self.closed = threading.Event()  # the consumer is gone or asked to stop

    def run(self) -> Iterator[Chunk | Done]:
        stop = self.request.stop
        if stop is not None and stop.is_set():
            yield Done("", [], self._finished("stopped", None))
            return
        server = self.backend.server if self.speculative else self.backend.plain()
        self.stats.prepare_s = time.perf_counter() - self.started
        chunks = self._serve(server)
        first = next(chunks, None)
        if self.speculative and first is not None and _refused(first):
            chunks.close()
            self.stats.mode, self.stats.fallback_reason = "plain", FALLBACK
            chunks = self._serve(self.backend.plain())
            first = next(chunks, None)
        if first is None:
            raise RequestError("llama.cpp answered nothing")
        text, token_ids, first_at, timings, reason, ids_known = "", [], None, None, None, True
        for chunk in _prepend(first, chunks):
            if stop is not None and stop.is_set():
                reason = "stopped"
                break
            if "error" in chunk or "code" in chunk:
                raise RequestError(f"llama.cpp failed: {_error(chunk)}")
            timings = chunk.get("timings") or timings
            choice = (chunk.get("choices") or [{}])[0]
            reason = choice.get("finish_reason") or reason
            piece = (choice.get("delta") or {}).get("content") or ""
            ids = [p["id"] for p in ((choice.get("logprobs") or {}).get("content") or [])]
            if not piece and not ids:
                continue
            now = time.perf_counter()
            first_at = now if first_at is None else first_at
            text, token_ids, ids_known = text + piece, token_ids + ids, ids_known and bool(ids)
            self.stats.new_tokens += max(1, len(ids))  # llama-server sends a chunk per token
            stream_timed(self.stats, self.started, first_at, now)
            yield Chunk(piece, ids, ["unknown"] * len(ids), copy.deepcopy(self.stats), [(piece, "unknown")] if piece else [])
        chunks.close()
        if reason is None:
            raise RequestError("llama.cpp ended the answer without a finish reason")
        if reason == "stop" and first_at is not None:  # the end token, never sent, counted and timed as the
            self.stats.new_tokens += 1  # built-in engine counts it: two equal answers, equal counts
            stream_timed(self.stats, self.started, first_at, time.perf_counter())
        self._server_counts(timings, reason)
        yield Done(text, token_ids if ids_known else [], self._finished(FINISH_REASONS.get(reason, reason), first_at))

    def _serve(self, server) -> Iterator[dict]:
        """The server's chunks for this body, as they come; closing the iterator stops the server."""
        chunks: queue.Queue = queue.Queue()
        stopped = threading.Event()

        def on_chunk(chunk) -> bool:
            chunks.put(chunk)
            return stopped.is_set() or (self.request.stop is not None and self.request.stop.is_set())

        def serve():
            try:
                server.handle_chat_completions(self.body, on_chunk)
            except Exception as error:  # e.g. a body the binding refuses: the consumer raises it
                chunks.put({"error": {"message": f"{type(error).__name__}: {error}"}})
            finally:
                chunks.put(_END)

        threading.Thread(target=serve, daemon=True, name="llama.cpp request").start()
        try:
            while (chunk := chunks.get()) is not _END:
                yield chunk
        finally:
            stopped.set()

    def _server_counts(self, timings: dict | None, reason: str | None = None) -> None:
        """What llama-server reported in the last chunk's `timings` (`reason`: its finish reason)."""
        if not timings:
            self.stats.unknown += ("prefill_s", "prefill_tokens", "drafted", "accepted", "acceptance")
            return
        self.stats.prefill_s = timings.get("prompt_ms", 0.0) / 1000
        self.stats.prefill_tokens = timings.get("prompt_n", 0) + timings.get("cache_n", 0)
        predicted = timings.get("predicted_n", 0)  # the end token included, as in new_tokens
        if predicted > self.stats.new_tokens and timings.get("predicted_ms"):
            # tokens the stream never showed one by one (llama-server holds back a piece that is not
            # yet whole UTF-8, as random weights write): the server's own count and decode time
            self.stats.new_tokens, self.stats.decode_tokens = predicted, predicted - 1
            self.stats.decode_s = timings["predicted_ms"] / 1000
            self.stats.decode_tok_s = self.stats.decode_tokens / self.stats.decode_s
        if self.stats.mode == "speculative":
            self.stats.drafted, self.stats.accepted = timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)
            self.stats.acceptance = self.stats.accepted / self.stats.drafted if self.stats.drafted else None

    def _finished(self, reason: str, first_at: float | None) -> Stats:
        self.stats.finish_reason = reason
        if first_at is None:
            self.stats.total_s = time.perf_counter() - self.started
        return copy.deepcopy(self.stats)


def _image_fit(checkpoint: str | Path | None, max_image_tokens: int) -> dict:
    """load_image's options for this model's images: the checkpoint's image processor with the
    family's budget of `max_image_tokens` applied (Family.image_budget: for Qwen-VL a pixel budget,
    which `fitted_size` then meets exactly), and the family; without a checkpoint, or for a family
    this project does not know, MAX_SIDE pixels on the longest side."""
    if checkpoint is None:
        return {"fit": LongestSide()}
    from transformers import AutoConfig
    from transformers.image_utils import SizeDict

    from models.families import family_for_config

    try:
        family = family_for_config(AutoConfig.from_pretrained(str(checkpoint)))
    except ValueError:
        return {"fit": LongestSide()}
    processor = family.load_processor(str(checkpoint))
    images = copy.copy(processor.image_processor)  # the budget on a copy: this backend's alone
    for key, value in family.image_budget(processor, max_image_tokens).items():
        setattr(images, key, SizeDict(**value) if isinstance(value, dict) else value)
    return {"fit": images, "family": family}


def _has_vision(checkpoint) -> bool:
    with open(Path(checkpoint) / "config.json", encoding="utf-8") as file:
        return "vision_config" in json.load(file)


def _refused(chunk: dict) -> bool:
    return "error" in chunk and IMAGE_REFUSAL in _error(chunk)


def _error(chunk: dict) -> str:
    error = chunk.get("error", chunk)
    message = error.get("message", error) if isinstance(error, dict) else error
    return " ".join(str(message).split())[:200]


def _prepend(first, rest: Iterator) -> Iterator:
    yield first
    yield from rest


def _field_names() -> list[str]:
    from dataclasses import fields

    return [f.name for f in fields(Stats)]
