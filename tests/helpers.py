"""Helpers the test modules share: the app served in-process, the reference answers it is checked
against, the gate that holds an answer mid-decode, and the process's memory.

A test that needs an answer still running holds it at a `Gate` (never at "long enough"):

    with Gate(server.engine.target.runner, at=5) as gate:
        job = client.submit(message("Describe the image."), max_new_tokens=400, api_name="/chat")
        gate.wait()                       # the answer is about to run its 5th target pass
        client.predict(api_name="/stop")  # ...which is where it stops: stats["target_forwards"] == 5
    partial, stats = job.result(timeout=120)   # leaving the block released the gate
"""

from __future__ import annotations

import gc
import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch
from gradio_client import handle_file
from gradio_client.utils import Status
from PIL import Image

import app
from app_ui import setup
from engine.__main__ import main as cli_main
from engine.engine import Engine
from engine.images import load_image
from engine.loop import Chunk, DecodeSettings, Done, PassRequest
from tests.conftest import ROOT

SHORT = 24  # max_new_tokens of a reference answer unless asked: enough to stream, quick on a shared CPU
WAIT_S = 120  # the longest a test waits for the server to reach a point it must reach


class Gate:
    """Holds the target's `at`-th pass (a call of `runner.extend`, counted from entering the block:
    each decode or chain-verify pass is one) until the test releases it. `wait()` returns when that
    pass has been asked for and is held; leaving the block releases it and restores the runner.
    A Stop sent while the pass is held ends the answer right after that pass. Draft trees verify
    through `extend_tree`, which the gate does not count."""

    def __init__(self, runner, at: int = 1):
        self.runner, self.at, self.calls = runner, at, 0
        self.held, self.opened = threading.Event(), threading.Event()
        self.extend, self.own_extend = runner.extend, vars(runner).get("extend")  # own: another test's wrapper

    def __enter__(self) -> Gate:
        self.runner.extend = self._extend  # on the instance: the class's method is untouched
        return self

    def __exit__(self, *error) -> None:
        self.release()
        if self.own_extend is None:
            del self.runner.extend
        else:
            self.runner.extend = self.own_extend

    def wait(self, timeout: float = WAIT_S) -> None:
        assert self.held.wait(timeout), f"the answer never reached target pass {self.at} ({self.calls} passes)"

    def release(self) -> None:
        self.opened.set()

    def _extend(self, state, token_ids):
        self.calls += 1
        if self.calls == self.at:
            self.held.set()
            self.opened.wait(WAIT_S)  # bounded: a failed test must not hang the server forever
        return self.extend(state, token_ids)


class StreamGate:
    """Holds a backend's stream (engine/backend.py) once it has handed its `at`-th Chunk to the app,
    until the test releases it: the gate for backends whose decoding the test cannot reach (llama.cpp
    in its own threads). `texts`: the chunks' texts handed over so far. A Stop sent while it is held
    ends the answer at the backend's next chunk: the answer is `"".join(gate.texts)`."""

    def __init__(self, backend, at: int = 1):
        self.backend, self.at, self.texts = backend, at, []
        self.held, self.opened = threading.Event(), threading.Event()

    def __enter__(self) -> StreamGate:
        stream = self.backend.stream

        def gated(request):
            for event in stream(request):
                yield event
                if isinstance(event, Chunk):
                    self.texts.append(event.text)
                    if len(self.texts) == self.at:
                        self.held.set()
                        self.opened.wait(WAIT_S)  # bounded: a failed test must not hang the server forever

        self.backend.stream = gated  # on the instance: the class's method is untouched
        return self

    def __exit__(self, *error) -> None:
        self.opened.set()
        del self.backend.stream

    def wait(self, timeout: float = WAIT_S) -> None:
        assert self.held.wait(timeout), f"the answer never handed over chunk {self.at} ({len(self.texts)} chunks)"

    def release(self) -> None:
        self.opened.set()


def wait_until(condition, what: str, timeout: float = WAIT_S) -> None:
    """Until `condition()` holds, polled (for what the server offers no event for: its queue, its
    sweeps of idle conversations); fails after `timeout` seconds saying `what` never happened."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


def wait_for_output(job) -> None:
    """Until a gradio_client job has streamed its first output."""
    wait_until(lambda: job.outputs(), "the answer's first output")


def wait_until_queued(*jobs) -> None:
    """Until each gradio_client job waits in the server's queue."""
    wait_until(lambda: all(job.status().code == Status.IN_QUEUE for job in jobs), "queued")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_app(zoo, *argv: str, models: list[str] | None = None, **main_options) -> SimpleNamespace:
    """`python app.py --model M --drafter D --no-browser` with the tiny Qwen2-VL target and its text
    drafter (n-gram comes too), or with the flags `models` instead (e.g. the bundled demo's: zoo may
    then be None), as a user starts it: no --host, no --share, none of their environment variables.
    `url`, `demo`, the `engine` it built (for gates and faults; None with --backend, which loads no
    model) and the `backends` it opened (--backend, --ab-backend; None where not set)."""
    built = {}
    load_engine, open_backends = setup.load_engine, setup.open_backends

    def keep(config):
        built["engine"] = load_engine(config)
        return built["engine"]

    def keep_backends(config):
        built["backends"] = open_backends(config)
        return built["backends"]

    if models is None:
        models = ["--model", str(zoo.dir("qwen2_vl")), "--drafter", str(zoo.dir("qwen2_vl", "text_drafter"))]
    with pytest.MonkeyPatch.context() as patch:
        for name in ("VLM_HOST", "GRADIO_SERVER_NAME", "SPACE_ID", "VLM_SHARE", "GRADIO_SHARE"):
            patch.delenv(name, raising=False)
        patch.setattr(setup, "load_engine", keep)
        patch.setattr(setup, "open_backends", keep_backends)
        demo = app.main([*models, "--port", str(free_port()), "--no-browser", *argv], block=False, **main_options)
    return SimpleNamespace(url=demo.local_url, demo=demo, engine=built.get("engine"), backends=built["backends"])


def app_fixture(*argv: str, **main_options):
    """A module-scoped fixture: the app as `launch_app(zoo, *argv, **main_options)` serves it,
    closed after the module. A test module names it: `server = app_fixture(limits=LIMITS)`."""

    @pytest.fixture(scope="module")
    def server(zoo):
        served = launch_app(zoo, *argv, **main_options)
        yield served
        served.demo.close()

    return server


def reference_engine(zoo) -> Engine:
    """The reference: the app's weights with its drafters, loaded apart from the app."""
    return Engine(zoo.target("qwen2_vl"), {"text": zoo.drafter("qwen2_vl", "text_drafter"),
                                           "ngram": zoo.drafter("qwen2_vl", "ngram")})


def reference(engine, turns: list[tuple[str, list[str], str | None]], drafter="text", max_new_tokens=SHORT) -> Done:
    """The engine's answer to the last of `turns` = [(text, image paths, earlier answer or None)]."""
    messages = []
    for text, paths, answer in turns:
        content = [{"type": "image", "image": load_image(p)} for p in paths] + [{"type": "text", "text": text}]
        messages.append({"role": "user", "content": content})
        if answer is not None:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    *_, done = engine.stream(messages, drafter=drafter, decode=DecodeSettings(max_new_tokens=max_new_tokens))
    return done


def message(text: str, paths: list[str] = ()) -> dict:
    """A /chat message as gradio_client sends it."""
    return {"text": text, "files": [handle_file(p) for p in paths]}


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("VmRSS")).split()[1]) * 1024


def live_objects() -> dict[str, int]:
    """How many tensors and PIL images the process holds."""
    gc.collect()
    objects = gc.get_objects()
    return {"tensors": sum(isinstance(obj, torch.Tensor) for obj in objects),
            "images": sum(isinstance(obj, Image.Image) for obj in objects)}


def live_images() -> list[Image.Image]:
    gc.collect()
    return [obj for obj in gc.get_objects() if isinstance(obj, Image.Image)]


def cli_json(capsys, argv: list[str]) -> dict:
    """What `python -m engine ARGV --json` prints, parsed; the exit status must be 0."""
    assert cli_main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


# A fake OpenAI-compatible server: chat-completion chunks in llama-server's format (llama.cpp
# tools/server/server-task.cpp: a role delta, one content delta a token, a last chunk with
# finish_reason, a usage chunk carrying `timings`, then `data: [DONE]`); vLLM's and SGLang's
# additions from tests/fixtures (each names its source).
PIECES = ["The", " red", " square", " is", " larger."]
TIMINGS = {"prompt_n": 9, "prompt_ms": 12.5, "predicted_n": 5, "predicted_ms": 40.0, "draft_n": 6,
           "draft_n_accepted": 4}
DEMO_TARGET = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "demo", "target")
DEMO_TEXT_DRAFTER = os.path.join(os.path.dirname(DEMO_TARGET), "text_drafter")


def chunk(delta: dict | None = None, finish: str | None = None, **extra) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "tiny", "choices": choices, **extra}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def llama_server_answer(timings: dict | None = TIMINGS, pieces: list[str] = PIECES, final: dict | None = None,
                        before_usage: tuple[dict, ...] = ()) -> list[bytes]:
    """The stream's lines; `final`: more fields of the usage chunk (vLLM's `metrics`);
    `before_usage`: chunks with empty choices before it (SGLang's `sglext`)."""
    usage = {"completion_tokens": len(pieces), "prompt_tokens": 9, "total_tokens": 9 + len(pieces)}
    final = {"usage": usage, **({"timings": timings} if timings else {}), **(final or {})}
    return ([chunk({"role": "assistant", "content": None})] + [chunk({"content": p}) for p in pieces]
            + [chunk({}, "stop"), *(chunk(None, **extra) for extra in before_usage), chunk(None, **final),
               b"data: [DONE]\n\n"])


class FakeServer:
    """Answers /v1/chat/completions with `self.reply` (status, body lines), /v1/models with
    `self.models`, and any other GET path with `self.pages[path]` (replies (status, body) served
    in turn, the last one again and again; 404 when none); holds before line `hold_at` until
    `release` is set; records what it received (POSTs: headers, body; GETs: paths)."""

    def __init__(self):
        self.reply: tuple[int, list[bytes]] = (200, llama_server_answer())
        self.models: list[dict] = [{"id": "tiny-vlm", "object": "model"}]
        self.pages: dict[str, list[tuple[int, bytes]]] = {}
        self.hold_at, self.held, self.release = None, threading.Event(), threading.Event()
        self.requests, self.gets, self.disconnected = [], [], threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                server.gets.append(self.path)
                if self.path == "/v1/models":
                    return self._send(200, [json.dumps({"object": "list", "data": server.models}).encode()])
                replies = server.pages.get(self.path) or [(404, b'{"error": {"message": "Not Found"}}')]
                status, body = replies.pop(0) if len(replies) > 1 else replies[0]
                self._send(status, [body], hold=False)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append((dict(self.headers), body))
                self._send(*server.reply)

            def _send(self, status, lines, hold=True):
                self.send_response(status)
                self.send_header("Content-Type", "text/event-stream" if status == 200 else "application/json")
                self.end_headers()
                try:
                    for i, line in enumerate(lines):
                        if hold and i == server.hold_at:
                            server.held.set()
                            server.release.wait(WAIT_S)
                        self.wfile.write(line)
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    server.disconnected.set()

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.http.shutdown()
        self.http.server_close()


# The bundled demo model's checkpoints (tests/conftest.py's `llamacpp` fixture converts them to GGUF).
DEMO_TARGET = os.path.join(ROOT, "assets", "demo", "target")
DEMO_TEXT_DRAFTER = os.path.join(ROOT, "assets", "demo", "text_drafter")


class GarbageServer:
    """Stands in for llama.cpp's `xllamacpp.Server`: calls back with what a broken server might
    send (`chunks`), or raises `error` as a server that is gone would."""

    def __init__(self, chunks=(), error: Exception | None = None):
        self.chunks, self.error = chunks, error

    def handle_chat_completions(self, body, callback):
        if self.error is not None:
            raise self.error
        for chunk in self.chunks:
            if callback(chunk):
                return


# The browser tests: Debian's chromium, driven by Playwright (tests/conftest.py `browser`).
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
EXAMPLES = os.path.join(ROOT, "assets", "examples")


def send(page, box_id: str, text: str, files: list[str]) -> None:
    """Attach `files` (assets/examples) to the message box `box_id`, type `text`, press Enter."""
    from playwright.sync_api import expect

    box = page.locator(f"#{box_id}")
    box.locator("input[type=file]").set_input_files([os.path.join(EXAMPLES, f) for f in files])
    expect(box.locator("img")).to_have_count(len(files), timeout=30_000)  # uploaded, thumbnails shown
    box.locator("textarea").fill(text)
    box.locator("textarea").press("Enter")


def held_after_first_event(steps, hold):
    """An answer's steps (Engine._steps, loop.answer: events, and target passes whose logits come
    back by send) that calls `hold()` after its first event: the answer holds the engine's worker there."""
    events, reply = 0, None
    while True:
        try:
            item = steps.throw(reply) if isinstance(reply, BaseException) else steps.send(reply)
        except StopIteration as end:
            return end.value
        reply = yield item
        if not isinstance(item, PassRequest):
            events += 1
            if events == 1:
                hold()

