"""The Gradio app, launched in-process on a free port with tiny models and driven with
gradio_client like any API user; answers are checked against the engine's own answers for
the same conversation (float32, greedy: exactly equal)."""

from __future__ import annotations

import re
import threading

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

import app
from app_ui import callbacks, highlight, views
from app_ui.session import Options, Session, new_turn
from app_ui.setup import read_config
from engine.ab import Side, compare, first_difference_index
from engine.loop import DecodeSettings
from engine.stats import Stats
from tests.conftest import ROOT
from tests.helpers import (SHORT, Gate, app_fixture, message, reference, wait_until,
                           wait_until_queued)

IMAGES = [f"{ROOT}/assets/examples/two_scenes_a.png", f"{ROOT}/assets/examples/chart.png"]
STATS_KEYS = {"decode_tok_s", "ttft_s", "prefill_s", "acceptance", "tokens_per_forward", "drafted", "accepted",
              "fallback_reason", "finish_reason", "summary"}
LONG = 400  # max_new_tokens of an answer held at a gate and stopped: "Describe the image." never ends early


server = app_fixture("--host", "127.0.0.1")


@pytest.fixture(scope="module")
def url(server):
    return server.url


def test_chat_streams_answer_and_statistics_and_keeps_images_in_history(url, engine):
    client = Client(url, verbose=False)
    job = client.submit(message("Describe each image.", IMAGES), max_new_tokens=SHORT, api_name="/chat")
    answer, stats = job.result(timeout=120)
    expected = reference(engine, [("Describe each image.", IMAGES, None)])
    assert answer == expected.text
    assert len(job.outputs()) >= 2  # streamed: partial answers, then the whole
    assert all(expected.text.startswith(partial) for partial, _ in job.outputs())
    assert STATS_KEYS <= stats.keys()
    assert stats["mode"] == "speculative" and stats["drafter_kind"] == "text_lm"
    assert stats["new_tokens"] == len(expected.token_ids) and stats["prefill_image_tokens"] > 0
    assert stats["drafted"] >= stats["accepted"] and stats["decode_tok_s"] > 0

    # The second turn sees the first, images included (history per client session).
    follow_up, stats = client.predict(message("And the chart?"), mode="plain", max_new_tokens=SHORT,
                                      api_name="/chat")
    expected = reference(engine, [("Describe each image.", IMAGES, answer), ("And the chart?", [], None)], drafter=None)
    assert follow_up == expected.text
    assert stats["mode"] == "plain" and stats["prefill_image_tokens"] > 0 and stats["acceptance"] is None

    # Another client has its own, empty history.
    other, _ = Client(url, verbose=False).predict(message("And the chart?"), max_new_tokens=SHORT, api_name="/chat")
    assert other == reference(engine, [("And the chart?", [], None)]).text


def test_ab_greedy_answers_are_identical(url, engine):
    client = Client(url, verbose=False)
    plain, speculative, speedup, identical, difference = client.predict(
        message("What does this chart show?", IMAGES[1:]), max_new_tokens=SHORT, draft_tree=5, api_name="/ab")
    assert plain == speculative == reference(engine, [("What does this chart show?", IMAGES[1:], None)]).text
    assert identical is True and difference is None
    assert speedup > 0


def test_stop_mid_answer_then_next_turn_is_answered_as_by_a_fresh_engine(server, engine):
    assert len(reference(engine, [("Describe the image.", [], None)], None, LONG).token_ids) == LONG  # no early end
    client = Client(server.url, verbose=False)
    with Gate(server.engine.target.runner, at=3) as gate:
        job = client.submit(message("Describe the image."), mode="plain", max_new_tokens=LONG, api_name="/chat")
        gate.wait()
        client.predict(api_name="/stop")
    partial, stats = job.result(timeout=60)
    assert stats["finish_reason"] == "stopped" and stats["new_tokens"] == 4  # the first token, then 3 passes

    answer, stats = client.predict(message("Describe each image.", IMAGES), max_new_tokens=SHORT, api_name="/chat")
    expected = reference(engine, [("Describe the image.", [], partial), ("Describe each image.", IMAGES, None)])
    assert answer == expected.text and stats["finish_reason"] != "stopped"

    # A cancelled request (the client went away mid-answer) also leaves the engine ready. Gradio
    # answers the cancel, then closes the answer's stream, which waits for the held pass.
    with Gate(server.engine.target.runner, at=3) as gate:
        job = client.submit(message("Describe the image."), mode="plain", max_new_tokens=LONG, api_name="/chat")
        gate.wait()
        cancelling = threading.Thread(target=job.cancel)
        cancelling.start()
        wait_until(job.done, "the request ended for its client")
    cancelling.join()
    # the next visitor: a client of its own (gradio_client's event stream of the one that cancelled
    # can hand a cancellation on to its next request; seen once in CI)
    after = Client(server.url, verbose=False)
    answer, _ = after.predict(message("Describe each image.", IMAGES), max_new_tokens=SHORT, api_name="/chat")
    assert answer == reference(engine, [("Describe each image.", IMAGES, None)]).text


def test_one_generation_at_a_time_and_a_waiting_client_sees_its_place(server, engine):
    first, second = Client(server.url, verbose=False), Client(server.url, verbose=False)
    with Gate(server.engine.target.runner) as gate:  # the first answer holds the engine
        running = first.submit(message("Describe the image."), mode="plain", max_new_tokens=LONG, api_name="/chat")
        gate.wait()
        waiting = second.submit(message("And the chart?"), max_new_tokens=SHORT, api_name="/chat")
        wait_until_queued(waiting)
        status = waiting.status()
        assert status.rank == 0 and status.queue_size >= 1
        first.predict(api_name="/stop")  # stops the first client's answer only
    assert running.result(timeout=60)[1]["finish_reason"] == "stopped"
    answer, stats = waiting.result(timeout=60)
    assert stats["finish_reason"] != "stopped"
    assert answer == reference(engine, [("And the chart?", [], None)]).text  # nothing of the first conversation


def test_bad_requests_are_explained_and_the_conversation_goes_on(url, engine, tmp_path):
    client = Client(url, verbose=False)
    first, _ = client.predict(message("Describe each image.", IMAGES), max_new_tokens=SHORT, api_name="/chat")

    bad = tmp_path / "holiday.png"
    bad.write_text("not a picture")
    with pytest.raises(AppError, match=r"holiday\.png: not an image file"):
        client.predict(message("What is this?", [str(bad)]), api_name="/chat")
    with pytest.raises(AppError, match=r"limit is 8 images per conversation"):
        client.predict(message("So many.", IMAGES * 4), api_name="/chat")  # 8 new + 2 earlier
    with pytest.raises(AppError, match=r"the prompt is \d+ tokens .*the model's context is 2048"):
        client.predict(message("word " * 2100), api_name="/chat")
    with pytest.raises(AppError, match="the message is empty"):
        client.predict(message("  "), api_name="/chat")
    with pytest.raises(AppError, match="nope is not in the list of choices"):  # Gradio checks the dropdown
        client.predict(message("Hi"), drafter="nope", api_name="/chat")

    # None of them joined the history: the next turn follows the first directly.
    answer, _ = client.predict(message("And the chart?"), max_new_tokens=SHORT, api_name="/chat")
    expected = reference(engine, [("Describe each image.", IMAGES, first), ("And the chart?", [], None)])
    assert answer == expected.text


def test_in_the_ui_a_refused_turn_goes_back_into_the_box_with_the_reason(engine):
    """A message over the context: the reason is a notice, the text (and images) go back into the
    message box, and the conversation is as it was."""
    session = Session()
    session.pending = new_turn({"text": "word " * 2100, "files": [IMAGES[0]]}, engine, session)
    with pytest.warns(UserWarning, match="Cannot answer: .*the model's context is 2048"):
        *_, (chatbot, *_, box) = callbacks.respond(engine, session, Options(max_new_tokens=4))
    assert box == {"text": ("word " * 2100).strip(), "files": [IMAGES[0]]}
    assert chatbot == [] and session.pending is None and session.turns == []  # never sent to the model


def test_missing_model_is_one_line_not_a_traceback(tmp_path):
    with pytest.raises(SystemExit) as stopped:
        app.main(["--model", str(tmp_path / "nowhere"), "--no-browser"])
    assert str(stopped.value) == f"error: --model {tmp_path / 'nowhere'}: no such folder"


def test_flags_win_over_environment_variables():
    environ = {"VLM_MODEL": "env-model", "VLM_DRAFTER": "a,b", "VLM_PORT": "9000", "VLM_NO_BROWSER": "1"}
    config = read_config([], environ)
    assert (config.model, config.drafters, config.port, config.open_browser) == ("env-model", ["a", "b", "ngram"],
                                                                                   9000, False)
    config = read_config(["--model", "m", "--drafter", "none", "--port", "7000"], environ)
    assert (config.model, config.drafters, config.port, config.host) == ("m", [], 7000, "127.0.0.1")
    assert read_config([], {"SPACE_ID": "me/app"}).host == "0.0.0.0"


def test_compare_reports_where_answers_first_differ(engine):
    tokenizer = engine.target.tokenizer
    ids = tokenizer("The sky is blue and the grass is green.")["input_ids"]
    other = ids[:5] + tokenizer(" red")["input_ids"] + ids[6:]
    plain = Side("plain", token_ids=ids, done=True, stats=Stats(mode="plain", decode_tokens=10, decode_tok_s=10.0,
                                                                 total_s=2.0))
    speculative = Side("speculative", token_ids=other, done=True, stats=Stats(decode_tokens=10, decode_tok_s=20.0,
                                                                            total_s=1.0))
    result = compare(tokenizer, plain, speculative)
    assert not result.identical and result.first_difference.index == 5
    assert result.first_difference.char_index == len(tokenizer.decode(ids[:5]))
    assert result.decode_speedup == 2.0 and result.time_ratio == 2.0
    assert first_difference_index([1, 2], [1, 2, 3]) == 2 and first_difference_index([1], [1]) is None


def test_highlighted_spans_follow_token_origins(engine):
    """The runs of the live highlight, built from a real speculative stream: they spell the
    answer, and alternate between the target's own text and accepted drafts."""
    messages = [{"role": "user", "content": "Describe the sky at night in a few sentences."}]
    side = Side("speculative")
    for event in engine.stream(messages, drafter="text", decode=DecodeSettings(max_new_tokens=40)):
        side.update(event)
    spans = highlight.highlighted(side)
    assert "".join(text for text, _ in spans) == side.text
    labels = [label for _, label in spans]
    assert all(a != b for a, b in zip(labels, labels[1:]))
    assert side.stats.accepted > 0 or highlight.DRAFT_LABEL not in labels


def test_the_image_token_budget_is_a_setting_of_the_api(url):
    """max_image_tokens caps the tokens of each image (0: the processor's own limit); the
    statistics say which budget applied; a negative budget is refused by name."""
    client = Client(url, verbose=False)
    photo = f"{ROOT}/assets/examples/rocket.jpg"
    image_tokens = {}
    for budget in (0, 4):
        client.predict(api_name="/clear")
        _, stats = client.predict(message("Describe it.", [photo]), max_image_tokens=budget, max_new_tokens=2,
                                  api_name="/chat")
        image_tokens[budget] = stats["prefill_image_tokens"]
        assert stats["max_image_tokens"] == (budget or None)
    assert image_tokens[4] < image_tokens[0]
    with pytest.raises(AppError, match="max_image_tokens"):
        client.predict(message("Hi"), max_image_tokens=-1, api_name="/chat")


@pytest.mark.usefixtures("one_thread")
def test_tree_setting_drafts_trees_and_the_panel_shows_them(engine):
    """Options.draft_tree reaches the loop; the panel names the tree; the highlight marks the
    accepted path's tokens as drafts and spells the plain answer."""
    messages = [{"role": "user", "content": "Describe the sky at night in a few sentences."}]
    side = Side("speculative")
    for event in engine.stream(messages, drafter="text", decode=Options(max_new_tokens=40, draft_tree=6).decode()):
        side.update(event)
    assert side.stats.draft_shape == "tree" and "nodes verified" in views.stats_markdown(side.stats)
    assert side.token_ids == reference(engine, [(messages[0]["content"], [], None)], None, 40).token_ids
    spans = highlight.highlighted(side)
    assert "".join(text for text, _ in spans) == side.text
    assert side.stats.accepted > 0 or highlight.DRAFT_LABEL not in [label for _, label in spans]


def test_the_starting_page_names_the_step_until_it_closes(capsys):
    """app_ui/starting.py: the address answers "Starting…" and the step under way; each announced
    step is printed as it begins and with its time; closed, the port is free for the app."""
    import urllib.request

    from app_ui.starting import MARKER, Startup
    from tests.helpers import free_port

    startup, port = Startup(), free_port()
    startup.serve("127.0.0.1", port)
    try:
        with startup.step("Loading the model"):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as page:
                body = page.read().decode()
        with startup.step("A quick step", announce=False):
            pass
    finally:
        startup.close()
    assert "Starting…" in body and "Step 1: Loading the model …" in body and MARKER in body
    assert re.search(r'id="elapsed">\d+ s since the start<', body), body
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"Starting on http://127.0.0.1:{port}/")
    assert printed[1] == "Loading the model …" and re.fullmatch(r"Loading the model: \d+\.\d s", printed[2])
    assert len(printed) == 3  # the quick step says nothing
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)


def test_every_sidebar_control_is_the_schemas(engine):
    """app_ui/components.py `settings_controls` makes each control from engine/settings.py `control`:
    the label everywhere, the range of every slider (but the image budget, the loaded model's) and the
    choices of the mode; a control per setting, in the schema's order."""
    import gradio as gr

    from app_ui import components
    from app_ui.served import Served
    from engine import settings as schema

    with gr.Blocks():
        controls = components.settings_controls(Served.built_in(engine))
    assert list(controls) == schema.names()
    for name, control in controls.items():
        shown = schema.control(name)
        assert control.label == shown["label"], name
        if isinstance(control, gr.Slider) and name != "max_image_tokens":
            assert (control.minimum, control.maximum, control.step) == shown["range"], name
            assert (control.value, control.info) == (shown["value"], shown["info"]), name
    assert [choice[1] for choice in controls["mode"].choices] == list(schema.MODES)
    assert (controls["max_image_tokens"].minimum, controls["max_image_tokens"].step) == (0, 16)
