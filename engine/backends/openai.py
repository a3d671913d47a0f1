"""A remote OpenAI-compatible server behind the backend interface (engine/backend.py):
llama-server, vLLM, SGLang, or any server with `POST /v1/chat/completions` and `stream: true`.

    backend = OpenAIServer("http://127.0.0.1:8080")          # the API key, if any, from VLM_BACKEND_API_KEY
    backend = OpenAIServer("http://gpu:8000#Qwen/Qwen2.5-VL-7B-Instruct")   # a model by name (or model=...)
    for event in backend.stream(Request(messages)):
        ...

Wire format (the OpenAI chat-completions streaming reference; llama.cpp's
tools/server/server-task.cpp `to_json_oaicompat_chat_stream`): server-sent events, one JSON
`chat.completion.chunk` per `data:` line, `choices[0].delta.content` the new text,
`choices[0].finish_reason` "stop" or "length" on the last chunk, then `data: [DONE]`. With
`stream_options.include_usage` a last chunk carries `usage` (completion_tokens, prompt_tokens).
llama-server adds `timings` to the last chunk: `prompt_ms`, and `draft_n` / `draft_n_accepted`
when it drafted (omitted when draft_n is 0). Messages: engine/backends/messages.py (images shrunk
to `max_image_side`, in their place among the text).

The server, asked once on the first request: `GET /v1/models` gives the model (the one named, which
must be listed, else the first) and the server's kind from its `owned_by` ("vllm", "sglang",
"llamacpp"); llama-server's `GET /props` gives its chat template (does it label images?), `GET /slots`
whether it drafts. A turn with images that its draft model refuses goes to `images`, if given (below).

What is measured here, from the stream (time.perf_counter() on this machine): `prepare_s` (the
request's start to the request sent: images encoded, vLLM's /metrics read), `ttft_s` (to the first
text), `decode_s` and `decode_tok_s` (first text to the last), `total_s`. Token counts while
streaming count text chunks (llama-server sends one per token; vLLM and SGLang with speculative
decoding may send several tokens in one); the final count is the server's `usage.completion_tokens`.
From the server: `prefill_tokens` (usage), `prefill_s` (llama-server's timings.prompt_ms), and
drafted / accepted tokens: llama-server's `timings`; vLLM's `metrics.speculative_decoding`, else its
/metrics counters read around the request (`Stats.drafts_approximate` says why when other requests
may be counted); SGLang's `sglext.spec_tokens_details` (engine/backends/metrics.py). What the
server does not say is listed in `Stats.unknown`, never guessed.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from engine.backend import Capabilities, Request, stream_timed
from engine.backends.messages import MAX_SIDE, LongestSide, labels_images, openai_content
from engine.backends.metrics import (MetricsError, record_drafts, sglang_request_counts, vllm_request_counts,
                                     vllm_response_counts)
from engine.engine import RequestError
from engine.loop import Chunk, Done
from engine.prompt import Prompt
from engine.stats import Stats

API_KEY_VARIABLE = "VLM_BACKEND_API_KEY"
TIMEOUT_S = 120.0  # the longest wait for the server to connect or to send the next line
FINISH_REASONS = {"stop": "stop_token", "length": "max_new_tokens"}
KINDS = ("vllm", "sglang", "llamacpp")  # the `owned_by` each writes into /v1/models (docs/backends.md)
IMAGE_WORDS = ("image", "multimodal", "mmproj", "vision")  # in an error about a turn with images
# A llama-server with a text model as its draft model under an M-RoPE target (Qwen2-VL) refuses every
# turn with images so, and no request field of b11549 turns its draft model off (docs/backends.md
# says what the source does); such turns go to `images`, a server without the draft model, if given.
SPECULATIVE_IMAGE_REFUSAL = "failed to process speculative batch"
STALE_DRAFT_REFUSAL = "failed to process mtmd chunk"  # the next image turn there: its draft cache was left behind
MEASURED = frozenset({"prepare_s", "ttft_s", "decode_tokens", "decode_s", "decode_tok_s", "total_s",
                      "new_tokens", "finish_reason", "tok_s_curve", "drafts_approximate", "fallback_reason"})
FROM_SERVER = ("mode", "prefill_tokens", "prefill_s", "drafted", "accepted", "acceptance", "tokens_per_forward",
               "accepted_by_position", "drafted_by_position")  # known if it says


@dataclass
class Server:
    """What the server said of itself, once."""

    model: str | None  # None: no /v1/models to ask; the request then names none
    kind: str | None = None  # one of KINDS, or None: another server
    label_images: bool = False  # it flattens messages and its template labels images (llama-server)
    per_request_drafts: bool = False  # vLLM sends metrics.speculative_decoding: /metrics is not read
    metrics: bool = True  # vLLM's /metrics answered (or was not asked yet)
    drafts: bool = False  # a llama-server whose /slots say they speculate
    refuses_images: bool = False  # a llama-server whose draft model refused a turn with images


class OpenAIServer:
    def __init__(self, url: str, model: str | None = None, api_key_variable: str = API_KEY_VARIABLE,
                 timeout_s: float = TIMEOUT_S, environ=os.environ, max_image_side: int = MAX_SIDE,
                 images: OpenAIServer | None = None):
        """`url`: the server's base, with or without `/v1`, optionally `#model` (the model's name);
        `model`: the same, as an argument (None: the first of the server's /v1/models);
        `max_image_side`: images are shrunk to this many pixels on their longest side; `images`: the
        server that answers turns with images, plainly, when this one is a llama-server whose draft
        model refuses them (SPECULATIVE_IMAGE_REFUSAL above; None: such a turn is refused by name)."""
        url, _, named = url.partition("#")
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the backend must be an http:// or https:// URL, got {url!r}")
        self.base = url.rstrip("/").removesuffix("/v1")
        self.endpoint = self.base + "/v1"
        self.model = model or urllib.parse.unquote(named) or None
        self.api_key = environ.get(api_key_variable) or None  # sent to the server only, never shown
        self.timeout_s, self.max_image_side, self.images = timeout_s, max_image_side, images
        self.server: Server | None = None  # asked on the first request (the app starts while it is down)
        self.requests = {"running": 0, "started": 0}  # this backend's requests, for overlap
        self.lock = threading.Lock()
        shown = f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "") + parts.path
        self.capabilities = Capabilities(shown.rstrip("/"), images=True, speculative=True,
                                         statistics=MEASURED | set(FROM_SERVER))

    def image_fit(self) -> dict:
        """engine/images.py load_image's options: images shrunk as they are decoded, to what is sent."""
        return {"fit": LongestSide(self.max_image_side)}

    def stream(self, request: Request) -> Iterator[Chunk | Done]:
        started = time.perf_counter() if request.started is None else request.started
        stats = Stats(unknown=self.capabilities.unknown() + FROM_SERVER)
        if request.stop is not None and request.stop.is_set():
            yield Done("", [], _finished(stats, "stopped", started, None))
            return
        if request.drafter is not None:
            raise RequestError(f"drafter {request.drafter!r}: the server at {self.capabilities.name} decides its own "
                               "speculative decoding; send no drafter")
        server = self._server()
        answered = False
        try:
            if server.refuses_images and _has_images(request.messages):  # refused before: not sent again (a
                raise _DraftRefusal(self.capabilities.name)  # second try can fail at the image: stale draft cache)
            for event in self._answer(request, server, started, stats):
                answered = True
                yield event
        except _DraftRefusal:
            server.refuses_images = True
            if answered or self.images is None:
                raise
            yield from self._plainly(request, started)

    def _answer(self, request: Request, server: Server, started: float, stats: Stats) -> Iterator[Chunk | Done]:
        body = self._body(request, server)
        before = self._metrics(server)
        stats.prepare_s = time.perf_counter() - started
        text, first_at, last, reason = "", None, {}, None
        with self._counted() as overlap, self._send(body, server) as response:
            for chunk in _chunks(response, self.capabilities.name):
                if request.stop is not None and request.stop.is_set():
                    reason = "stopped"
                    break
                last.update({key: chunk[key] for key in ("usage", "timings", "metrics", "sglext") if chunk.get(key)})
                choice = (chunk.get("choices") or [{}])[0]
                reason = choice.get("finish_reason") or reason
                piece = (choice.get("delta") or {}).get("content") or ""
                if not piece:
                    continue
                now = time.perf_counter()
                first_at = now if first_at is None else first_at
                text += piece
                stats.new_tokens += 1
                stream_timed(stats, started, first_at, now)
                yield Chunk(piece, [], [], stats.snapshot(), [(piece, "unknown")])
        if reason is None:
            raise RequestError(f"the backend at {self.capabilities.name} ended the stream before the answer ended")
        _server_counts(stats, last.get("usage"), last.get("timings"))
        self._draft_counts(stats, server, last, before, overlap)
        yield Done(text, [], _finished(stats, FINISH_REASONS.get(reason, reason), started, first_at))

    def _plainly(self, request: Request, started: float) -> Iterator[Chunk | Done]:
        """A turn with images answered by `self.images`; every event's statistics say why."""
        reason = (f"the llama-server at {self.capabilities.name} drafts with a draft model that cannot take a turn "
                  "with images (failed to process speculative batch), and llama.cpp has no per-request switch to "
                  f"plain decoding: answered by {self.images.capabilities.name}")
        for event in self.images.stream(replace(request, started=started)):
            event.stats.fallback_reason = reason
            yield event

    def _body(self, request: Request, server: Server) -> dict:
        if isinstance(request.messages, Prompt):
            raise RequestError("a remote backend takes messages, not a prepared Prompt")
        sampling, decode = request.sampling, request.decode
        counter = iter(range(1, 10**6))  # images are numbered across the conversation, as templates do
        messages = [{"role": m["role"], "content": openai_content(m["content"], server.label_images, counter,
                                                                  self.image_fit())}
                    for m in request.messages]
        body = {"messages": messages, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": decode.max_new_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p}
        if server.model is not None:
            body["model"] = server.model
        if sampling.top_k:
            body["top_k"] = sampling.top_k  # not in OpenAI's API; llama-server, vLLM and SGLang read it
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if server.kind == "sglang":
            body["return_spec_tokens_details"] = True  # sglext.spec_tokens_details (SGLang PR #33518)
        return body

    def _server(self) -> Server:
        """The model and what the server is, asked once (not kept while the server cannot be reached)."""
        if self.server is not None:
            return self.server
        models = self._get("/v1/models")  # RequestError (a ValueError) when the server cannot be reached
        try:
            listed = [m for m in json.loads(models or b"null")["data"]
                      if isinstance(m, dict) and isinstance(m.get("id"), str)]
        except (ValueError, KeyError, TypeError):
            listed = []
        names = [m["id"] for m in listed]
        if self.model is None and not names:
            raise RequestError(f"the backend at {self.capabilities.name} lists no model at /v1/models; name one: "
                               "--backend URL#model")
        if self.model is not None and names and self.model not in names:
            raise RequestError(f"the backend at {self.capabilities.name} has no model {self.model!r}; it serves: "
                               + ", ".join(names[:10]) + (", ..." if len(names) > 10 else ""))
        model = self.model or names[0]
        kind = next((m.get("owned_by") for m in listed if m["id"] == model), None)
        server = Server(model, kind if kind in KINDS else None)
        if server.kind == "llamacpp":
            props, slots = self._get("/props"), self._get("/slots")  # /slots: 501 when started with --no-slots
            try:
                server.label_images = labels_images(json.loads(props or b"{}").get("chat_template") or "")
                server.drafts = any(s.get("speculative") is True for s in json.loads(slots or b"[]"))
            except (ValueError, AttributeError, TypeError):
                pass
        self.server = server
        return server

    def _metrics(self, server: Server) -> str | None:
        """vLLM's /metrics text, for counts read around a request; None when not to be read."""
        if server.kind != "vllm" or server.per_request_drafts or not server.metrics:
            return None
        text = self._get("/metrics")
        server.metrics = text is not None
        return None if text is None else text.decode("utf-8", errors="replace")

    def _draft_counts(self, stats: Stats, server: Server, last: dict, before: str | None, overlap: dict) -> None:
        """Drafted / accepted from vLLM or SGLang (llama-server's timings: _server_counts)."""
        spec, details = _inner(last, "metrics", "speculative_decoding"), _inner(last, "sglext", "spec_tokens_details")
        try:
            if spec is not None:
                server.per_request_drafts = True
                record_drafts(stats, vllm_response_counts(spec), None)
            elif details is not None:
                record_drafts(stats, sglang_request_counts(details), None)
            elif before is not None and (after := self._metrics(server)) is not None:
                counts = vllm_request_counts(before, after)
                why = ("other requests ran on the server meanwhile" if counts and counts.approximate else
                       "other requests of this app ran meanwhile" if overlap["overlapped"] else None)
                record_drafts(stats, counts, why)
        except (MetricsError, RequestError):
            pass  # not in the documented format, or /metrics unreachable after the answer: unknown

    @contextmanager
    def _counted(self):
        """Counts this request among this backend's; yields {"overlapped"}, set when it ends."""
        with self.lock:
            self.requests["running"] += 1
            self.requests["started"] += 1
            overlap = {"alone": self.requests["running"] == 1, "started": self.requests["started"]}
        try:
            yield overlap
        finally:
            with self.lock:
                self.requests["running"] -= 1
                overlap["overlapped"] = not overlap["alone"] or self.requests["started"] != overlap["started"]

    @contextmanager
    def _send(self, body: dict, server: Server):
        """The streamed response; a refused turn with images says so by name, whether the server
        refuses it with an HTTP error or with an error event in the stream."""
        try:
            with self._open("/chat/completions", body) as response:
                yield response
        except RequestError as error:
            images = any(isinstance(m["content"], list) and any(p["type"] == "image_url" for p in m["content"])
                         for m in body["messages"])
            message = error.message if isinstance(error, _HTTPError) else str(error)
            if images and server.kind == "llamacpp" and (SPECULATIVE_IMAGE_REFUSAL in message
                                                         or server.drafts and STALE_DRAFT_REFUSAL in message):
                raise _DraftRefusal(self.capabilities.name) from None
            if images and isinstance(error, _HTTPError) and any(word in message.lower() for word in IMAGE_WORDS):
                raise RequestError(f"the backend at {self.capabilities.name} does not take images "
                                   f"(model {server.model!r}): {message}; send text only") from None
            raise

    def _get(self, path: str) -> bytes | None:
        """The body of GET `path` on the server's base; None when it answers an HTTP error."""
        try:
            with self._open(path, base=self.base) as response:
                return response.read()
        except _HTTPError:
            return None

    def _open(self, path: str, body: dict | None = None, base: str | None = None):
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream" if body else "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        try:
            return urllib.request.urlopen(urllib.request.Request((base or self.endpoint) + path, data, headers),
                                          timeout=self.timeout_s)
        except urllib.error.HTTPError as error:
            message = _error_message(error.read())
            raise _HTTPError(f"the backend at {self.capabilities.name} answered HTTP {error.code}: {message}",
                             message) from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise RequestError(f"the backend at {self.capabilities.name} cannot be reached: {reason}") from None


class _HTTPError(RequestError):
    """The server answered an HTTP error; `message`: its own words."""

    def __init__(self, text: str, message: str):
        super().__init__(text)
        self.message = message


class _DraftRefusal(RequestError):
    """A llama-server's draft model refused a turn with images (SPECULATIVE_IMAGE_REFUSAL)."""

    def __init__(self, name: str):
        super().__init__(f"the llama-server at {name} drafts with a draft model, and llama.cpp cannot draft on a turn "
                         "with images (failed to process speculative batch); its version offers no per-request switch "
                         "to plain decoding: start the app with --image-backend URL of the same model served without "
                         "--model-draft, or start this one without it, or send text only")


def _has_images(messages: list[dict]) -> bool:
    return any(isinstance(m["content"], list) and any(p.get("type") == "image" for p in m["content"])
               for m in messages)


def _chunks(response, name: str) -> Iterator[dict]:
    """The JSON objects of a server-sent event stream, up to `data: [DONE]`."""
    try:
        for raw in response:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line or line.startswith((":", "event:", "id:", "retry:")):
                continue
            if not line.startswith("data:"):
                raise RequestError(f"the backend at {name} sent something other than a server-sent event stream: "
                                   f"{line[:80]!r}")
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                return
            try:
                chunk = json.loads(data)
            except ValueError:
                raise RequestError(f"the backend at {name} sent an event that is not JSON: {data[:80]!r}") from None
            if not isinstance(chunk, dict):
                raise RequestError(f"the backend at {name} sent an event that is not an object: {data[:80]!r}")
            if "error" in chunk:
                raise RequestError(f"the backend at {name} failed: {_error_message(json.dumps(chunk).encode())}")
            yield chunk
    except (TimeoutError, OSError) as error:
        raise RequestError(f"the backend at {name} stopped sending: {error}") from None


def _error_message(body: bytes) -> str:
    """The `error.message` of an OpenAI-style error body, else its first characters, on one line."""
    try:
        error = json.loads(body)["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", errors="replace")
    return " ".join(str(message).split())[:200] or "(no message)"


def _server_counts(stats: Stats, usage: dict | None, timings: dict | None) -> None:
    """What the server reported at the end; what it did not stays unknown."""
    known = set()
    if usage and isinstance(usage.get("completion_tokens"), int):
        stats.new_tokens = usage["completion_tokens"]
        stats.decode_tokens = max(stats.new_tokens - 1, 0)
        stats.decode_tok_s = stats.decode_tokens / stats.decode_s if stats.decode_s > 0 else 0.0
        stats.prefill_tokens = usage.get("prompt_tokens") or 0
        known.add("prefill_tokens")
    if timings and isinstance(timings.get("prompt_ms"), (int, float)):
        stats.prefill_s = timings["prompt_ms"] / 1000
        known.add("prefill_s")
    if timings is not None and "predicted_n" in timings:  # llama-server: draft_n is omitted when 0
        stats.drafted, stats.accepted = timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)
        stats.acceptance = stats.accepted / stats.drafted if stats.drafted else None
        stats.mode = "speculative" if stats.drafted else "plain"
        known |= {"mode", "drafted", "accepted", "acceptance"}
    stats.unknown = tuple(name for name in stats.unknown if name not in known)


def _inner(last: dict, outer: str, name: str) -> dict | None:
    """`last[outer][name]` when both are objects (vLLM's metrics, SGLang's sglext), else None."""
    value = last.get(outer)
    value = value.get(name) if isinstance(value, dict) else None
    return value if isinstance(value, dict) else None


def _finished(stats: Stats, reason: str, started: float, first_at: float | None) -> Stats:
    stats.finish_reason = reason
    if first_at is None:
        stats.total_s = time.perf_counter() - started
    return stats.snapshot()
