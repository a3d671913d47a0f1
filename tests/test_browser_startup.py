"""Start-up in the open (issue 38, item 15): while the model loads, the app's address answers a
page that says "Starting…" and names the step (desktop and phone), which becomes the chat when
the model is ready; each step is printed with its time. The model's load is held at a gate."""

from __future__ import annotations

import os
import threading
import time
import urllib.request

import pytest

import app
from app_ui import setup
from models.presets import DEMO_MODEL
from tests.helpers import CHROMIUM, free_port

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is missing: install Debian's chromium (scripts/test.sh does)")


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def test_the_page_says_starting_until_the_model_is_ready_and_each_step_is_printed(zoo, browser, monkeypatch,
                                                                                  capsys):
    from playwright.sync_api import expect

    gate, load = threading.Event(), setup.load_engine

    def held(config):
        assert gate.wait(120), "the test never released the load"
        return load(config)

    monkeypatch.setattr(setup, "load_engine", held)
    models = (["--preset", "demo"] if os.path.isdir(DEMO_MODEL) else
              ["--model", str(zoo.dir("qwen2_vl")), "--drafter", str(zoo.dir("qwen2_vl", "text_drafter"))])
    port, started = free_port(), {}
    url = f"http://127.0.0.1:{port}/"
    thread = threading.Thread(target=lambda: started.update(demo=app.main(
        [*models, "--port", str(port), "--host", "127.0.0.1", "--no-browser"], block=False)))
    thread.start()
    pages = [browser.new_page(viewport={"width": 1366, "height": 900}),
             browser.new_page(viewport={"width": 360, "height": 740}, is_mobile=True, has_touch=True)]
    try:
        deadline = time.monotonic() + 120
        while not answers(url):
            assert time.monotonic() < deadline and thread.is_alive(), "the address never answered"
            time.sleep(0.2)
        for page in pages:
            page.goto(url)
            expect(page.locator("#starting")).to_have_text("Starting…")
            expect(page.locator("#step")).to_contain_text("Loading")
            assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        os.makedirs(os.path.join("artifacts", "screenshots"), exist_ok=True)
        pages[1].screenshot(path=os.path.join("artifacts", "screenshots", "starting-phone.png"))
        gate.set()
        for page in pages:  # the same tab becomes the app, no reload by hand
            expect(page.locator("#chat-input textarea")).to_be_visible(timeout=180_000)
        thread.join(60)
        printed = capsys.readouterr().out
        assert f"Starting on {url}" in printed
        for step in ("Loading", "Warming up"):
            assert f"\n{step}" in printed and " s\n" in printed.split(f"\n{step}", 1)[1], printed
        assert "Running on" in printed and "ready" in printed.split("Running on", 1)[1], printed
    finally:
        gate.set()
        for page in pages:
            page.close()
        thread.join(120)
        if "demo" in started:
            started["demo"].close()
