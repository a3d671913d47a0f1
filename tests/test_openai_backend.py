"""The remote OpenAI-compatible backend (engine/backends/openai.py) against a small HTTP server
(tests/helpers.py, FakeServer) that streams chat-completion chunks in llama-server's format (llama.cpp
tools/server/server-task.cpp: a role delta, one content delta a token, a last chunk with
finish_reason, a usage chunk carrying `timings`, then `data: [DONE]`)."""

from __future__ import annotations

import base64
import io
import json
import socket
import threading

import pytest
from PIL import Image

from engine.backend import Request
from engine.backends.openai import OpenAIServer
from engine.engine import RequestError
from engine.loop import Chunk, DecodeSettings, Done
from engine.sampling import SamplingSettings
from tests.helpers import PIECES, WAIT_S, FakeServer, chunk, llama_server_answer


@pytest.fixture
def server():
    server = FakeServer()
    yield server
    server.close()


def ask(text="Which is larger?", images=()) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image} for image in images]
             + [{"type": "text", "text": text}]}]


def test_answer_text_and_statistics_from_the_stream_and_the_server(server):
    events = list(OpenAIServer(server.url).stream(Request(ask(), decode=DecodeSettings(max_new_tokens=32))))
    chunks, done = events[:-1], events[-1]
    assert [e.text for e in chunks] == PIECES and isinstance(done, Done) and done.text == "The red square is larger."
    assert [e.stats.new_tokens for e in chunks] == [1, 2, 3, 4, 5]  # each event its own snapshot
    stats = done.stats
    assert (stats.finish_reason, stats.new_tokens, stats.decode_tokens, stats.prefill_tokens) == ("stop_token", 5, 4, 9)
    assert (stats.mode, stats.drafted, stats.accepted, stats.acceptance) == ("speculative", 6, 4, 4 / 6)
    assert stats.prefill_s == 0.0125 and stats.ttft_s >= stats.prepare_s >= 0 and stats.total_s >= stats.ttft_s
    values = stats.as_dict()
    for name in ("target_forwards", "tokens_per_forward", "accepted_by_position", "draft_lengths", "drafter"):
        assert name in stats.unknown and values[name] is None  # not reported: unknown, not zero
    assert values["drafted"] == 6 and "drafted" not in stats.unknown
    assert all(e.token_ids == [] and e.origins == [] for e in chunks)  # the server gives neither


def test_the_request_carries_settings_images_and_the_key_from_the_environment(server):
    backend = OpenAIServer(server.url + "/v1/", environ={"VLM_BACKEND_API_KEY": "sk-secret"})
    image = Image.new("RGB", (12, 7), (200, 10, 10))
    list(backend.stream(Request(ask("What colour?", [image]), sampling=SamplingSettings(0.5, 0.9, 40, 7),
                                decode=DecodeSettings(max_new_tokens=17))))
    headers, body = server.requests[0]
    assert headers["Authorization"] == "Bearer sk-secret" and "secret" not in backend.capabilities.name
    assert body["model"] == "tiny-vlm" and body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["top_k"], body["seed"]) == (17, 0.5, 0.9, 40, 7)
    image_part, text_part = body["messages"][0]["content"]
    assert text_part == {"type": "text", "text": "What colour?"}
    url = image_part["image_url"]["url"]
    assert image_part["type"] == "image_url" and url.startswith("data:image/png;base64,")
    sent = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert sent.size == (12, 7) and sent.getpixel((0, 0)) == (200, 10, 10)


def test_a_server_that_does_not_report_drafts_leaves_them_unknown(server):
    server.reply = (200, llama_server_answer(timings=None))
    stats = list(OpenAIServer(server.url).stream(Request(ask())))[-1].stats
    assert {"drafted", "accepted", "acceptance", "mode", "prefill_s"} <= set(stats.unknown)
    assert stats.as_dict()["drafted"] is None and stats.new_tokens == 5 and "prefill_tokens" not in stats.unknown
    server.reply = (200, llama_server_answer(timings={"prompt_ms": 3.0, "predicted_n": 5}))  # llama-server, no drafts
    stats = list(OpenAIServer(server.url).stream(Request(ask())))[-1].stats
    assert (stats.mode, stats.drafted, stats.acceptance) == ("plain", 0, None) and "drafted" not in stats.unknown


@pytest.mark.parametrize("reply, message", [
    ((200, [b"<html>hello</html>\n"]), "sent something other than a server-sent event stream: '<html>"),
    ((200, [b"data: {not json\n\n"]), "sent an event that is not JSON"),
    ((500, [b'{"error": {"code": 500, "message": "failed to process\\nspeculative batch"}}']),
     "answered HTTP 500: failed to process speculative batch"),
    ((200, [b'data: {"error": {"message": "context full"}}\n\n']), "failed: context full"),
    ((200, llama_server_answer()[:3]), "ended the stream before the answer ended"),
])
def test_garbage_and_errors_give_one_line(server, reply, message):
    server.reply = reply
    with pytest.raises(RequestError, match=message) as error:
        list(OpenAIServer(server.url).stream(Request(ask())))
    assert "\n" not in str(error.value)


def test_a_server_that_is_down_gives_one_line():
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # closed at once: nothing listens there
    with pytest.raises(RequestError, match=f"127.0.0.1:{port} cannot be reached") as error:
        list(OpenAIServer(f"http://127.0.0.1:{port}", model="m").stream(Request(ask())))
    assert "\n" not in str(error.value)


def test_stop_mid_stream_keeps_what_came(server):
    server.hold_at = 3  # after the role delta and two pieces
    stop = threading.Event()
    stream = OpenAIServer(server.url).stream(Request(ask(), stop=stop))
    first, _ = next(stream), next(stream)
    assert isinstance(first, Chunk) and server.held.wait(WAIT_S)
    stop.set()
    server.release.set()
    rest = list(stream)
    assert len(rest) == 1 and rest[0].text == "The red" and rest[0].stats.finish_reason == "stopped"


def test_closing_the_stream_closes_the_connection(server):
    server.reply = (200, llama_server_answer()[:3] + [chunk({"content": " more"})] * 5000)
    server.hold_at = 3
    stream = OpenAIServer(server.url).stream(Request(ask()))
    next(stream)
    assert server.held.wait(WAIT_S)
    stream.close()
    server.release.set()
    assert server.disconnected.wait(WAIT_S)


def test_a_drafter_or_a_stop_before_the_start(server):
    with pytest.raises(RequestError, match="decides its own speculative decoding"):
        list(OpenAIServer(server.url).stream(Request(ask(), drafter="text")))
    stop = threading.Event()
    stop.set()
    assert [e.stats.finish_reason for e in OpenAIServer(server.url).stream(Request(ask(), stop=stop))] == ["stopped"]
    assert server.requests == []
    with pytest.raises(ValueError, match="http:// or https://"):
        OpenAIServer("ftp://example.org")


def test_the_command_line_answers_through_a_server(server, capsys):
    from engine.__main__ import main

    assert main(["--backend", server.url, "--json", "Which is larger?"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["text"] == "The red square is larger." and printed["stats"]["drafted"] == 6
    assert printed["stats"]["target_forwards"] is None
    assert main(["--backend", "localhost:8080", "hi"]) == 2
    assert capsys.readouterr().err.startswith("error: the backend must be an http:// or https:// URL")
