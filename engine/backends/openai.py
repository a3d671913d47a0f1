"""A remote OpenAI-compatible server behind the backend interface (engine/backend.py):
llama-server, vLLM, SGLang, or any server with `POST /v1/chat/completions` and `stream: true`.

    backend = OpenAIServer("http://127.0.0.1:8080")   # the API key, if any, from VLM_BACKEND_API_KEY
    for event in backend.stream(Request(messages)):
        ...

Wire format (the OpenAI chat-completions streaming reference; llama.cpp's
tools/server/server-task.cpp `to_json_oaicompat_chat_stream`): server-sent events, one JSON
`chat.completion.chunk` per `data:` line, `choices[0].delta.content` the new text,
`choices[0].finish_reason` "stop" or "length" on the last chunk, then `data: [DONE]`. With
`stream_options.include_usage` a last chunk carries `usage` (completion_tokens, prompt_tokens).
llama-server adds `timings` to the last chunk: `prompt_ms`, and `draft_n` / `draft_n_accepted`
when it drafted (omitted when draft_n is 0). Images go as `image_url` parts with data URLs.

What is measured here, from the stream (time.perf_counter() on this machine): `prepare_s` (the
request's start to the request sent, images encoded), `ttft_s` (to the first text), `decode_s`
and `decode_tok_s` (first text to the last), `total_s`. Token counts while streaming count
text chunks (llama-server sends one per token; vLLM with speculative decoding may send several
tokens in one); the final count is the server's `usage.completion_tokens`. From the server:
`prefill_tokens` (usage), `prefill_s` (timings.prompt_ms), drafted / accepted (timings). What
the server does not say is listed in `Stats.unknown`, never guessed.
"""

from __future__ import annotations

import base64
import io
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator

from engine.backend import Capabilities, Request, stream_timed
from engine.engine import RequestError
from engine.loop import Chunk, Done
from engine.prompt import Prompt
from engine.stats import Stats

API_KEY_VARIABLE = "VLM_BACKEND_API_KEY"
TIMEOUT_S = 120.0  # the longest wait for the server to connect or to send the next line
FINISH_REASONS = {"stop": "stop_token", "length": "max_new_tokens"}
MEASURED = frozenset({"prepare_s", "ttft_s", "decode_tokens", "decode_s", "decode_tok_s", "total_s",
                      "new_tokens", "finish_reason", "tok_s_curve"})
FROM_SERVER = ("mode", "prefill_tokens", "prefill_s", "drafted", "accepted", "acceptance")  # known if it says


class OpenAIServer:
    def __init__(self, url: str, model: str | None = None, api_key_variable: str = API_KEY_VARIABLE,
                 timeout_s: float = TIMEOUT_S, environ=os.environ):
        """`url`: the server's base, with or without `/v1`. `model`: the name sent in each request
        (None: the first of the server's /v1/models, asked once)."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the backend must be an http:// or https:// URL, got {url!r}")
        base = url.rstrip("/").removesuffix("/v1")
        self.endpoint = base + "/v1"
        self.model = model
        self.api_key = environ.get(api_key_variable) or None  # sent to the server only, never shown
        self.timeout_s = timeout_s
        shown = f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "") + parts.path
        self.capabilities = Capabilities(shown.rstrip("/"), images=True, speculative=True,
                                         statistics=MEASURED | set(FROM_SERVER))

    def stream(self, request: Request) -> Iterator[Chunk | Done]:
        started = time.perf_counter() if request.started is None else request.started
        stats = Stats(unknown=self.capabilities.unknown() + FROM_SERVER)
        if request.stop is not None and request.stop.is_set():
            yield Done("", [], _finished(stats, "stopped", started, None))
            return
        if request.drafter is not None:
            raise RequestError(f"drafter {request.drafter!r}: the server at {self.capabilities.name} decides its own "
                               "speculative decoding; send no drafter")
        body = self._body(request)
        stats.prepare_s = time.perf_counter() - started
        text, first_at, usage, timings, reason = "", None, None, None, None
        with self._open("/chat/completions", body) as response:
            for chunk in _chunks(response, self.capabilities.name):
                if request.stop is not None and request.stop.is_set():
                    reason = "stopped"
                    break
                usage, timings = chunk.get("usage") or usage, chunk.get("timings") or timings
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
        _server_counts(stats, usage, timings)
        yield Done(text, [], _finished(stats, FINISH_REASONS.get(reason, reason), started, first_at))

    def _body(self, request: Request) -> dict:
        if isinstance(request.messages, Prompt):
            raise RequestError("a remote backend takes messages, not a prepared Prompt")
        sampling, decode = request.sampling, request.decode
        body = {"model": self.model or self._first_model(), "messages": [_message(m) for m in request.messages],
                "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": decode.max_new_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p}
        if sampling.top_k:
            body["top_k"] = sampling.top_k  # not in OpenAI's API; llama-server, vLLM and SGLang read it
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        return body

    def _first_model(self) -> str:
        with self._open("/models") as response:
            try:
                self.model = json.load(response)["data"][0]["id"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise RequestError(f"the backend at {self.capabilities.name} lists no model at /v1/models; "
                                   "name one") from None
        return self.model

    def _open(self, path: str, body: dict | None = None):
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream" if body else "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        try:
            return urllib.request.urlopen(urllib.request.Request(self.endpoint + path, data, headers),
                                          timeout=self.timeout_s)
        except urllib.error.HTTPError as error:
            raise RequestError(f"the backend at {self.capabilities.name} answered HTTP {error.code}: "
                               f"{_error_message(error.read())}") from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise RequestError(f"the backend at {self.capabilities.name} cannot be reached: {reason}") from None


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


def _message(message: dict) -> dict:
    """An engine/prompt.py message in OpenAI's format: text and image_url parts (data URLs)."""
    parts = []
    for part in message["content"]:
        if part["type"] == "text":
            parts.append({"type": "text", "text": part["text"]})
        else:
            buffer = io.BytesIO()
            part["image"].save(buffer, format="PNG")
            url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
            parts.append({"type": "image_url", "image_url": {"url": url}})
    if all(part["type"] == "text" for part in parts):  # plain text: a string, which every chat template takes
        return {"role": message["role"], "content": "".join(part["text"] for part in parts)}
    return {"role": message["role"], "content": parts}


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


def _finished(stats: Stats, reason: str, started: float, first_at: float | None) -> Stats:
    stats.finish_reason = reason
    if first_at is None:
        stats.total_s = time.perf_counter() - started
    return stats.snapshot()
