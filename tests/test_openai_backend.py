"""The remote OpenAI-compatible backend (engine/backends/openai.py) against a small HTTP server
(tests/helpers.py, FakeServer) that streams chat-completion chunks in llama-server's format (llama.cpp
tools/server/server-task.cpp: a role delta, one content delta a token, a last chunk with
finish_reason, a usage chunk carrying `timings`, then `data: [DONE]`)."""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import threading

import pytest
from PIL import Image

from app_ui import views
from engine.backend import Request
from engine.backends.openai import OpenAIServer
from engine.engine import RequestError
from engine.images import load_image
from engine.loop import Chunk, DecodeSettings, Done
from engine.sampling import SamplingSettings
from tests.helpers import DEMO_TARGET, DEMO_TEXT_DRAFTER, PIECES, WAIT_S, FakeServer, chunk, llama_server_answer

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


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


def fixture(name: str):
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as file:
        return file.read() if name.endswith(".txt") else json.load(file)


def test_a_model_by_name_asked_once_and_an_unknown_one_in_one_line(server):
    server.models = [{"id": "small", "owned_by": "vllm"}, {"id": "Qwen/Qwen2.5-VL-7B-Instruct", "owned_by": "vllm"}]
    backend = OpenAIServer(server.url + "/v1#Qwen%2FQwen2.5-VL-7B-Instruct")
    for _ in range(2):
        list(backend.stream(Request(ask())))
    assert [body["model"] for _, body in server.requests] == ["Qwen/Qwen2.5-VL-7B-Instruct"] * 2
    assert server.gets.count("/v1/models") == 1 and backend.server.kind == "vllm"
    with pytest.raises(RequestError, match=r"has no model 'big'; it serves: small, Qwen/Qwen2.5-VL-7B-Instruct$") as error:
        list(OpenAIServer(server.url, model="big").stream(Request(ask())))
    assert "\n" not in str(error.value) and len(server.requests) == 2  # nothing sent
    assert OpenAIServer(server.url).stream(Request(ask())).__next__().text == "The"  # none named: the first


def test_vllm_per_request_metrics_give_exact_drafts_and_stop_the_metrics_reads(server):
    server.models = [{"id": "tiny-vlm", "owned_by": "vllm"}]
    server.pages["/metrics"] = [(200, fixture("vllm_metrics_before.txt").encode())]
    final = fixture("vllm_chat_stream_spec_metrics.json")["chunk"]
    server.reply = (200, llama_server_answer(timings=None, final={"usage": final["usage"], "metrics": final["metrics"]}))
    backend = OpenAIServer(server.url)
    for _ in range(2):
        stats = list(backend.stream(Request(ask())))[-1].stats
        assert (stats.mode, stats.drafted, stats.accepted, stats.new_tokens) == ("speculative", 129, 10, 53)
        assert stats.accepted_by_position == [4, 3, 3] and stats.drafted_by_position == [43, 43, 43]
        assert stats.tokens_per_forward == 1 + 10 / 43 and stats.drafts_approximate is None
        assert not {"drafted", "accepted_by_position", "tokens_per_forward"} & set(stats.unknown)
        assert "target_forwards" in stats.unknown
    assert server.gets.count("/metrics") == 1  # before the first answer only: then the answers say it


def test_vllm_counters_read_around_the_request_and_approximate_when_others_ran(server):
    server.models = [{"id": "tiny-vlm", "owned_by": "vllm"}]
    server.reply = (200, llama_server_answer(timings=None))
    before, after = fixture("vllm_metrics_before.txt").encode(), fixture("vllm_metrics_after.txt").encode()
    server.pages["/metrics"] = [(200, before), (200, after)]
    backend = OpenAIServer(server.url)
    stats = list(backend.stream(Request(ask())))[-1].stats
    assert (stats.mode, stats.drafted, stats.accepted, stats.drafts_approximate) == ("speculative", 60, 40, None)
    assert stats.accepted_by_position == [17, 13, 10] and stats.drafted_by_position == [20, 20, 20]
    assert stats.tokens_per_forward == 1 + 40 / 20
    server.pages["/metrics"] = [(200, before), (200, fixture("vllm_metrics_after_overlapped.txt").encode())]
    stats = list(backend.stream(Request(ask())))[-1].stats
    assert stats.drafted == 90 and stats.drafts_approximate == "other requests ran on the server meanwhile"
    assert "approximate" in stats.summary()
    row = dict(views._stat_rows(stats))["Accepted / drafted"]
    assert row == "60 / 90 tokens (approximate: other requests ran on the server meanwhile)"
    server.pages["/metrics"] = [(200, b'vllm:num_requests_running{engine="0"} 0.0\n')]  # no speculative config
    stats = list(backend.stream(Request(ask())))[-1].stats
    assert (stats.mode, stats.drafted, stats.acceptance) == ("plain", 0, None) and "drafted" not in stats.unknown
    server.pages["/metrics"] = [(200, b"<html>proxy</html>\n")]  # not Prometheus: unknown, the answer kept
    done = list(backend.stream(Request(ask())))[-1]
    assert done.text == "The red square is larger." and "drafted" in done.stats.unknown


def test_requests_of_this_app_that_overlap_make_the_counts_approximate(server):
    server.models = [{"id": "tiny-vlm", "owned_by": "vllm"}]
    server.reply = (200, llama_server_answer(timings=None))
    server.pages["/metrics"] = [(200, fixture("vllm_metrics_before.txt").encode())]  # the server's gauges say idle
    server.hold_at = 3
    backend = OpenAIServer(server.url)
    first = backend.stream(Request(ask()))
    next(first)
    assert server.held.wait(WAIT_S)
    server.release.set()  # the second request runs while the first one is open
    second = list(backend.stream(Request(ask())))[-1].stats
    rest = list(first)[-1].stats
    assert second.drafts_approximate == rest.drafts_approximate == "other requests of this app ran meanwhile"
    assert (second.drafted, second.mode) == (0, "speculative")


def test_sglang_spec_tokens_details_asked_for_and_read(server):
    server.models = [{"id": "default", "owned_by": "sglang"}]
    sglext = fixture("sglang_chat_stream_sglext.json")
    server.reply = (200, llama_server_answer(timings=None, before_usage=({"sglext": sglext["chunk"]["sglext"]},)))
    stats = list(OpenAIServer(server.url).stream(Request(ask())))[-1].stats
    assert server.requests[0][1]["return_spec_tokens_details"] is True and server.gets == ["/v1/models"]
    assert (stats.mode, stats.drafted, stats.accepted) == ("speculative", 215, 63)
    assert stats.accepted_by_position == [32, 18, 7, 3, 3] and stats.drafted_by_position == [43] * 5
    assert stats.tokens_per_forward == pytest.approx(sglext["chunk"]["sglext"]["spec_tokens_details"]["spec_accept_length"])
    server.reply = (200, llama_server_answer(timings=None))  # no sglext (no speculation, or an older SGLang)
    stats = list(OpenAIServer(server.url).stream(Request(ask())))[-1].stats
    assert {"mode", "drafted", "accepted_by_position"} <= set(stats.unknown)


def test_images_keep_their_place_are_shrunk_and_labelled_where_llama_server_needs_it(server):
    photo = Image.effect_noise((3000, 2000), 60).convert("RGB")  # a photo's worth of detail
    small = Image.new("RGB", (12, 7), (200, 10, 10))
    parts = [{"type": "text", "text": "Compare "}, {"type": "image", "image": photo}, {"type": "text", "text": "with"},
             {"type": "text", "text": " "}, {"type": "image", "image": small}, {"type": "text", "text": "?"}]
    list(OpenAIServer(server.url).stream(Request([{"role": "user", "content": parts}])))
    content = server.requests[0][1]["messages"][0]["content"]
    assert [p.get("text", p["type"]) for p in content] == ["Compare ", "image_url", "with ", "image_url", "?"]
    big, tiny = (Image.open(io.BytesIO(base64.b64decode(p["image_url"]["url"].split(",", 1)[1])))
                 for p in content if p["type"] == "image_url")
    assert content[1]["image_url"]["url"].startswith("data:image/jpeg") and big.size == (1536, 1024)
    assert content[3]["image_url"]["url"].startswith("data:image/png") and tiny.getpixel((0, 0)) == (200, 10, 10)
    assert len(content[1]["image_url"]["url"]) < 1_500_000

    server.models = [{"id": "tiny-vlm", "owned_by": "llamacpp"}]  # llama-server flattens: the labels as text
    server.pages["/props"] = [(200, json.dumps({"chat_template": "{% if add_vision_id is not defined or "
                                                                 "add_vision_id %}Picture{% endif %}"}).encode())]
    list(OpenAIServer(server.url, max_image_side=64).stream(Request([{"role": "user", "content": parts}])))
    content = server.requests[1][1]["messages"][0]["content"]
    assert [p.get("text", "IMG") for p in content] == ["Compare Picture 1: ", "IMG", "with Picture 2: ", "IMG", "?"]


def test_the_app_decodes_images_no_larger_than_what_is_sent(tmp_path):
    path = tmp_path / "photo.jpg"
    Image.effect_noise((2400, 1800), 60).convert("RGB").save(path)
    assert load_image(str(path), **OpenAIServer("http://127.0.0.1:9", max_image_side=800).image_fit()).size == (800, 600)


def test_a_server_that_refuses_images_says_so_and_text_still_goes(server):
    refusal = b'{"error": {"code": 500, "message": "image input is not supported - hint: if this is unexpected, ' \
              b'you may need to provide the mmproj", "type": "server_error"}}'  # llama-server without mmproj
    server.reply = (500, [refusal])
    image = Image.new("RGB", (8, 8))
    with pytest.raises(RequestError, match=r"does not take images \(model 'tiny-vlm'\): image input is not "
                                           r"supported .* send text only$") as error:
        list(OpenAIServer(server.url).stream(Request(ask(images=[image]))))
    assert "\n" not in str(error.value)
    with pytest.raises(RequestError, match="answered HTTP 500: image input"):  # a text turn: not about its images
        list(OpenAIServer(server.url).stream(Request(ask())))


@pytest.fixture(scope="module")
def llama():
    """A real llama-server (in a child process) on the demo model in GGUF, with the text
    drafter as its draft model; its plain twin (no draft model) answers the image turns."""
    from engine.backends.llamacpp import LlamaCpp

    return LlamaCpp.from_checkpoint(DEMO_TARGET, draft=DEMO_TEXT_DRAFTER, threads=1)


def test_on_a_real_llama_server_the_answers_are_llama_cpps_own(llama):
    """Through its HTTP route: the same text as the llama.cpp backend on the same server, on a
    text turn (drafted by the draft model) and on turns with one and two images (labelled)."""
    from engine.backends.llamacpp import DRAFTER
    from models.demo.world import eval_questions

    decode = DecodeSettings(max_new_tokens=24)
    text_turn = ask("Describe a red circle in the top left corner.")
    remote = OpenAIServer(llama.url)
    done = list(remote.stream(Request(text_turn, decode=decode)))[-1]
    own = list(llama.stream(Request(text_turn, drafter=DRAFTER, decode=decode)))[-1]
    assert done.text and done.text == own.text and remote.server.kind == "llamacpp" and remote.server.label_images
    assert done.stats.mode == "speculative" and 0 < done.stats.drafted and done.stats.drafted == own.stats.drafted

    plain = OpenAIServer(llama.plain().listening_address)
    questions = [q for q in eval_questions(0, 8) if q.images]
    for question in (next(q for q in questions if len(q.images) == 1), next(q for q in questions if len(q.images) > 1)):
        turn = ask(question.prompt, question.images)
        done = list(plain.stream(Request(turn, decode=decode)))[-1]
        assert done.text == list(llama.stream(Request(turn, decode=decode)))[-1].text, question.prompt
        assert done.stats.mode == "plain" and done.stats.drafted == 0


def test_a_drafting_llama_server_refuses_an_image_turn_by_name_and_still_drafts_text(llama):
    from models.demo.world import eval_questions

    remote = OpenAIServer(llama.url)  # started with the text drafter as its draft model
    question = next(q for q in eval_questions(0, 8) if q.images)
    for _ in range(2):  # no server for images given: refused by name each time
        with pytest.raises(RequestError, match="drafts with a draft model, and llama.cpp cannot draft on a turn with "
                                               "images .*--image-backend URL .*without --model-draft") as error:
            list(remote.stream(Request(ask(question.prompt, question.images))))
        assert "\n" not in str(error.value)
    assert remote.server.drafts and remote.requests["started"] == 1  # /slots; the second turn was not sent
    done = list(remote.stream(Request(ask("Describe a red circle."), decode=DecodeSettings(max_new_tokens=12))))[-1]
    assert done.text and done.stats.mode == "speculative"


def test_a_drafting_llama_servers_image_turns_are_answered_plainly_by_the_image_server_with_the_reason(llama):
    """`images`: the same model served without the draft model (the llama.cpp backend's plain
    twin). An image turn refused by the drafting server (after the test before, which left its draft
    cache behind, with "failed to process mtmd chunk") is answered there, plainly, its statistics saying why;
    the next image turn goes there at once; text turns still draft."""
    from models.demo.world import eval_questions

    decode = DecodeSettings(max_new_tokens=12)
    images = OpenAIServer(llama.plain().listening_address)
    remote = OpenAIServer(llama.url, images=images)
    for question in [q for q in eval_questions(0, 8) if q.images][:2]:
        turn = ask(question.prompt, question.images)
        done = list(remote.stream(Request(turn, decode=decode)))[-1]
        assert done.text == list(llama.stream(Request(turn, decode=decode)))[-1].text, question.prompt  # plain's own
        assert (done.stats.mode, done.stats.drafted) == ("plain", 0)
        assert done.stats.fallback_reason.startswith(f"the llama-server at {remote.capabilities.name} drafts with a "
                                                     "draft model that cannot take a turn with images (failed to "
                                                     "process speculative batch)")
        assert dict(views._stat_rows(done.stats))["Fell back to plain"] == done.stats.fallback_reason  # the panel
    assert remote.server.refuses_images and (remote.requests["started"], images.requests["started"]) == (1, 2)
    text = list(remote.stream(Request(ask("Describe a red circle."), decode=decode)))[-1]
    assert (text.stats.mode, text.stats.fallback_reason) == ("speculative", None) and text.stats.drafted > 0
    assert images.requests["started"] == 2


def test_a_real_text_only_llama_server_refuses_an_image_turn_in_one_line():
    from engine.backends.llamacpp import LlamaCpp

    text_only = LlamaCpp.from_checkpoint(DEMO_TEXT_DRAFTER, threads=1)  # kept: dropping it stops the server
    remote = OpenAIServer(text_only.url)
    with pytest.raises(RequestError, match="does not take images .*mmproj") as error:
        list(remote.stream(Request(ask(images=[Image.new("RGB", (16, 16), (0, 0, 255))]))))
    assert "\n" not in str(error.value)
    assert list(remote.stream(Request(ask(), decode=DecodeSettings(max_new_tokens=4))))[-1].text  # text still goes
