"""The app served on a remote OpenAI-compatible backend (`python app.py --backend URL`), and the
A/B tab across two backends (`--ab-backend URL`): the app started in-process, driven with
gradio_client, the backend a FakeServer (tests/helpers.py) streaming llama-server's format."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from app_ui import callbacks, views
from app_ui.served import Served
from app_ui.session import Options, Session, new_turn
from engine.ab import MIN_PAIRS
from engine.backends.openai import OpenAIServer
from tests.conftest import ROOT
from tests.helpers import (CHROMIUM, PIECES, TIMINGS, WAIT_S, FakeServer, free_port, launch_app, llama_server_answer,
                           message, reference, reference_engine)

IMAGE = f"{ROOT}/assets/examples/chart.png"
ANSWER = "".join(PIECES)
SECRET = "sk-test-secret-123"


@pytest.fixture(scope="module")
def fake():
    server = FakeServer()
    yield server
    server.close()


@pytest.fixture
def fresh(fake):
    """The fake server as each test expects it first: the usual answer, nothing held or recorded."""
    fake.reply, fake.hold_at, fake.requests[:] = (200, llama_server_answer()), None, []
    fake.held.clear()
    fake.release.clear()
    return fake


@pytest.fixture(scope="module")
def served(zoo, fake):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLM_BACKEND_API_KEY", SECRET)
        app = launch_app(zoo, "--backend", fake.url)
    yield app
    app.demo.close()


def sent_text(body: dict) -> list[tuple[str, str]]:
    """(role, text) of each message a request sent, images left out."""
    def text(content):
        return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
    return [(m["role"], text(m["content"])) for m in body["messages"]]


def test_text_and_image_turns_through_the_server_with_the_key_kept_from_the_page(served, fresh):
    assert served.engine is None  # no model loaded
    client = Client(served.url, verbose=False)
    answer, stats = client.predict(message("Which is larger?"), max_new_tokens=32, api_name="/chat")
    assert answer == ANSWER
    assert (stats["new_tokens"], stats["drafted"], stats["accepted"], stats["prefill_s"]) == (5, 6, 4, 0.0125)
    assert stats["target_forwards"] is None and stats["tokens_per_forward"] is None  # not reported: null
    assert "target_forwards" in stats["unknown"] and "drafted" not in stats["unknown"]

    answer, _ = client.predict(message("And this chart?", [IMAGE]), api_name="/chat")
    assert answer == ANSWER
    (first_headers, first), (_, second) = fresh.requests
    assert first_headers["Authorization"] == f"Bearer {SECRET}"
    assert "drafter" not in first and first["max_tokens"] == 32
    image_part = second["messages"][-1]["content"][0]
    assert image_part["type"] == "image_url" and image_part["image_url"]["url"].startswith("data:image/png;base64,")
    assert sent_text(second) == [("user", "Which is larger?"), ("assistant", ANSWER), ("user", "And this chart?")]

    with urllib.request.urlopen(served.url + "config", timeout=WAIT_S) as page:  # what a browser gets
        config = page.read().decode()
    assert fresh.url.removeprefix("http://") in config and SECRET not in config and SECRET not in json.dumps(stats)


def test_the_panel_marks_what_the_server_does_not_report(fresh):
    """The live panel: reported figures shown, the others "not reported by this server", none made up."""
    rows, highlight = panel(fresh, timings=None)  # a server that says nothing of its drafts
    for name in ("Accepted / drafted", "Acceptance", "Decoding", "Tokens per target pass"):
        assert rows[name] == views.NOT_REPORTED
    assert rows["Prompt"] == f"9 tokens; read in: {views.NOT_REPORTED}"
    assert "which tokens were drafted is not reported" in highlight

    rows, _ = panel(fresh, timings=TIMINGS)  # llama-server with a draft model
    assert (rows["Accepted / drafted"], rows["Acceptance"], rows["Decoding"]) == ("4 / 6 tokens", "67%", "speculative · —")
    assert rows["Tokens per target pass"] == views.NOT_REPORTED and rows["Prompt"] == "9 tokens; read in: 0.013 s"


def panel(fake: FakeServer, timings: dict | None) -> tuple[dict[str, str], str]:
    """The chat's statistics panel (row name -> value) and highlight after one answer from `fake`."""
    fake.reply = (200, llama_server_answer(timings=timings))
    backend, session = Served.remote(OpenAIServer(fake.url)), Session()
    session.pending = new_turn({"text": "Which is larger?", "files": []}, backend, session)
    *_, (chatbot, table, highlight, *_) = callbacks.respond(backend, session, Options())
    assert chatbot[-1]["content"] == ANSWER
    return dict(line.strip("| ").split(" | ", 1) for line in table.splitlines()[2:]), highlight


@pytest.mark.parametrize("reply, error", [
    ((200, [b"<html>hello</html>\n"]), "sent something other than a server-sent event stream"),
    ((500, [b'{"error": {"message": "failed to process\\nspeculative batch"}}']),
     "answered HTTP 500: failed to process speculative batch"),
])
def test_garbage_from_the_server_is_one_line_and_the_conversation_is_kept(served, fresh, reply, error):
    client = Client(served.url, verbose=False)
    assert client.predict(message("Which is larger?"), api_name="/chat")[0] == ANSWER
    fresh.reply = reply
    with pytest.raises(AppError, match=error) as refused:
        client.predict(message("Why?"), api_name="/chat")
    assert "\n" not in str(refused.value)
    fresh.reply = (200, llama_server_answer())
    assert client.predict(message("Which is smaller?"), api_name="/chat")[0] == ANSWER
    assert sent_text(fresh.requests[-1][1]) == [
        ("user", "Which is larger?"), ("assistant", ANSWER), ("user", "Which is smaller?")]  # the failed turn left out


def test_a_server_that_refuses_an_image_turn_names_it_and_the_conversation_is_kept(served, fresh):
    client = Client(served.url, verbose=False)
    assert client.predict(message("Which is larger?"), api_name="/chat")[0] == ANSWER
    fresh.reply = (500, [b'{"error": {"code": 500, "message": "image input is not supported - hint: if this is '
                         b'unexpected, you may need to provide the mmproj"}}'])  # llama-server without mmproj
    with pytest.raises(AppError, match="does not take images .*send text only") as refused:
        client.predict(message("And this chart?", [IMAGE]), api_name="/chat")
    assert "\n" not in str(refused.value)
    fresh.reply = (200, llama_server_answer())
    assert client.predict(message("Which is smaller?"), api_name="/chat")[0] == ANSWER
    assert sent_text(fresh.requests[-1][1]) == [
        ("user", "Which is larger?"), ("assistant", ANSWER), ("user", "Which is smaller?")]


def test_a_server_that_is_down_is_one_line_and_the_app_keeps_serving(zoo):
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    app = launch_app(zoo, "--backend", down)
    try:
        client = Client(app.url, verbose=False)
        for _ in range(2):  # refused, and the next message too, each with the reason
            with pytest.raises(AppError, match="cannot be reached") as refused:
                client.predict(message("Hello?"), api_name="/chat")
            assert "\n" not in str(refused.value)
    finally:
        app.demo.close()


def test_stop_mid_stream_keeps_what_came_and_the_next_turn_follows(served, fresh):
    fresh.hold_at = 3  # the role delta and two pieces sent; the server holds there
    client = Client(served.url, verbose=False)
    job = client.submit(message("Which is larger?"), api_name="/chat")
    assert fresh.held.wait(WAIT_S)
    client.predict(api_name="/stop")
    fresh.release.set()
    partial, stats = job.result(timeout=WAIT_S)
    assert partial == "The red" and stats["finish_reason"] == "stopped"
    fresh.hold_at = None
    assert client.predict(message("Go on."), api_name="/chat")[0] == ANSWER
    assert sent_text(fresh.requests[-1][1]) == [("user", "Which is larger?"), ("assistant", "The red"),
                                                ("user", "Go on.")]


def test_ab_built_in_engine_against_a_server(zoo, fresh):
    """Side one: the built-in engine (speculative, the settings' drafter); side two: the server.
    The same answer is identical (compared as text: the server gives no token ids); another is not."""
    question = "What does this chart show?"
    app = launch_app(zoo, "--ab-backend", fresh.url)
    try:
        expected = reference(reference_engine(zoo), [(question, [IMAGE], None)], max_new_tokens=12).text
        fresh.reply = (200, llama_server_answer(pieces=[expected[i:i + 3] for i in range(0, len(expected), 3)]))
        client = Client(app.url, verbose=False)
        first, second, speedup, identical, difference = client.predict(
            message(question, [IMAGE]), max_new_tokens=12, api_name="/ab")
        assert first == second == expected and identical is True and difference is None and speedup > 0

        fresh.reply = (200, llama_server_answer(pieces=[expected[:4], "☃☃"]))
        first, second, _, identical, difference = client.predict(message(question, [IMAGE]), max_new_tokens=12,
                                                                 api_name="/ab")
        assert first == expected and second == expected[:4] + "☃☃" and identical is False
        assert difference["index"] == difference["char_index"] == 4 and difference["speculative"] == "☃☃"
        assert fresh.requests[-1][1]["max_tokens"] == 12
    finally:
        app.demo.close()


def test_ab_on_a_server_alone_says_what_to_do(served, fresh):
    with pytest.raises(AppError, match="--ab-backend URL"):
        Client(served.url, verbose=False).predict(message("Which is larger?"), api_name="/ab")
    assert fresh.requests == []


def test_ab_server_against_server(zoo, fresh):
    """`--backend A --ab-backend B`: each side from its own server, compared as text."""
    other = FakeServer()
    other.reply = (200, llama_server_answer(pieces=["The", " blue", " square"]))
    app = launch_app(zoo, "--backend", fresh.url, "--ab-backend", other.url)
    try:
        first, second, _, identical, difference = Client(app.url, verbose=False).predict(
            message("Which is larger?"), api_name="/ab")
        assert (first, second, identical) == (ANSWER, "The blue square", False)
        assert difference["index"] == 4 and difference["plain"].startswith("red")
        assert len(fresh.requests) == len(other.requests) >= MIN_PAIRS  # alternating pairs (engine/ab.py)
        assert all(request == fresh.requests[0] for request in fresh.requests)  # each a repeat of the first
    finally:
        app.demo.close()
        other.close()


def test_the_ab_tab_names_the_two_servers(fresh):
    other = FakeServer()
    try:
        first, second = Served.remote(OpenAIServer(fresh.url)), OpenAIServer(other.url)
        *_, (verdict, first_html, second_html, table) = callbacks.ab_live(
            first, {"text": "Which is larger?", "files": []}, Session(), Options(), 0.0, second)
        assert verdict.endswith("answers **identical** ✓") and second.capabilities.name in verdict
        assert f"**{second.capabilities.name}: " in verdict or f"between {second.capabilities.name} and {first.name}" in verdict
        assert table.splitlines()[0] == f"| Statistic | {first.name} | {second.capabilities.name} |"
        assert "which tokens were drafted is not reported" in first_html and ANSWER in second_html
    finally:
        other.close()


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing")
def test_in_the_browser_the_server_answers_and_the_panel_says_what_it_does_not_report(served, fresh, browser):
    from playwright.sync_api import expect

    fresh.reply = (200, llama_server_answer(timings=None))
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    page.goto(served.url)
    expect(page.locator("#header")).to_contain_text(fresh.url.removeprefix("http://"))
    expect(page.get_by_text("The server decides its own speculative decoding")).to_be_visible()
    expect(page.get_by_label("Drafter")).to_have_count(0)  # hidden: the server's own
    box = page.locator("#chat-input textarea")
    box.fill("Which is larger?")
    box.press("Enter")
    stats = page.locator("#stats")
    expect(stats).to_contain_text("end of answer", timeout=WAIT_S * 1000)
    expect(stats).to_contain_text(views.NOT_REPORTED)
    expect(page.locator("#chatbot .message.bot").first).to_contain_text(ANSWER)
    assert SECRET not in page.content()
    page.close()


def test_on_a_drafting_llama_server_a_picture_is_answered_plainly_by_the_image_backend(llamacpp):
    """`--backend URL` of a real llama-server that drafts (the `llamacpp` fixture's: the demo model
    with its text drafter as the draft model, which refuses turns with images) and `--image-backend
    URL` of the same model without it: a text turn drafts, a turn with a picture is answered
    plainly with the reason in its statistics, and so is every later turn of that conversation (its
    messages hold the picture); a new conversation's text turn drafts again."""
    from engine.backend import Request
    from engine.images import load_image
    from engine.loop import DecodeSettings

    plain_url, tokens = llamacpp.plain().listening_address, 16
    served = launch_app(None, "--backend", llamacpp.url, "--image-backend", plain_url, models=[])
    try:
        client = Client(served.url, verbose=False)
        first, stats = client.predict(message("Describe a red circle."), max_new_tokens=tokens, api_name="/chat")
        assert first and (stats["mode"], stats["fallback_reason"]) == ("speculative", None) and stats["drafted"] > 0
        second, stats = client.predict(message("What does this chart show?", [IMAGE]), max_new_tokens=tokens,
                                       api_name="/chat")
        conversation = [{"role": "user", "content": [{"type": "text", "text": "Describe a red circle."}]},
                        {"role": "assistant", "content": [{"type": "text", "text": first}]},
                        {"role": "user", "content": [{"type": "image", "image": load_image(IMAGE)},
                                                     {"type": "text", "text": "What does this chart show?"}]}]
        *_, own = OpenAIServer(plain_url).stream(Request(conversation, decode=DecodeSettings(max_new_tokens=tokens)))
        assert second == own.text and (stats["mode"], stats["drafted"]) == ("plain", 0)
        assert "drafts with a draft model that cannot take a turn with images" in stats["fallback_reason"]
        assert served.backends[0].images.capabilities.name in stats["fallback_reason"]
        third, stats = client.predict(message("Which is larger?"), max_new_tokens=tokens, api_name="/chat")
        assert third and (stats["mode"], stats["drafted"]) == ("plain", 0)  # the conversation holds the picture
        assert stats["fallback_reason"].startswith("the llama-server at")
        client.predict(api_name="/clear")
        fourth, stats = client.predict(message("Which is larger?"), max_new_tokens=tokens, api_name="/chat")
        assert fourth and stats["mode"] == "speculative" and stats["drafted"] > 0 and stats["fallback_reason"] is None
    finally:
        served.demo.close()


def test_the_image_backend_needs_a_server_url_as_backend():
    from app_ui import setup

    for argv in ([], ["--backend", "llamacpp"]):
        config = setup.read_config([*argv, "--image-backend", "http://127.0.0.1:9"], environ={})
        with pytest.raises(setup.SetupError, match="--image-backend answers the image turns of --backend URL"):
            setup.open_backends(config)
    config = setup.read_config(["--backend", "http://127.0.0.1:9", "--image-backend", "http://127.0.0.1:8"], environ={})
    backend, _ = setup.open_backends(config)  # servers are asked on the first request, not at start
    assert backend.images.capabilities.name == "http://127.0.0.1:8"
