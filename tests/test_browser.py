"""The app in a real browser: Debian's Chromium driven by Playwright (never a downloaded
browser). Uploads two images, asks, waits for the streamed answer and the statistics, runs an
A/B turn, and saves screenshots to artifacts/screenshots/ (chat.png, ab.png).

Uses the model named by VLM_MODEL (and VLM_DRAFTER) if set, else the bundled demo model when
assets/demo holds it (real answers in the screenshots), else tiny random models (the text is
gibberish, the mechanics the same)."""

from __future__ import annotations

import os
import re

import pytest

import app
from models.presets import DEFAULT_MODEL
from tests.conftest import ROOT
from tests.test_app import free_port

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOTS = os.path.join(ROOT, "artifacts", "screenshots")
EXAMPLES = os.path.join(ROOT, "assets", "examples")
FINISHED = re.compile("end of answer|max new tokens reached")

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is missing: install Debian's chromium (scripts/test.sh does)")


@pytest.fixture(scope="module")
def url(zoo):
    if os.environ.get("VLM_MODEL"):
        argv = []  # the model the environment names (VLM_MODEL, VLM_DRAFTER: see app_ui/setup.py)
    elif os.path.isdir(DEFAULT_MODEL):
        argv = ["--preset", "demo"]
    else:
        argv = ["--model", str(zoo.dir("qwen2_vl")), "--drafter", str(zoo.dir("qwen2_vl", "text_drafter"))]
    demo = app.main(argv + ["--port", str(free_port()), "--host", "127.0.0.1", "--no-browser"], block=False)
    yield demo.local_url
    demo.close()


@pytest.fixture(scope="module")
def page(url):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        page.goto(url)
        yield page
        browser.close()


def send(page, box_id: str, text: str, files: list[str]) -> None:
    box = page.locator(f"#{box_id}")
    box.locator("input[type=file]").set_input_files([os.path.join(EXAMPLES, f) for f in files])
    from playwright.sync_api import expect

    expect(box.locator("img")).to_have_count(len(files), timeout=30_000)  # uploaded, thumbnails shown
    box.locator("textarea").fill(text)
    box.locator("textarea").press("Enter")


def test_chat_with_two_images_streams_answer_and_statistics(page):
    from playwright.sync_api import expect

    send(page, "chat-input", "Describe each image.", ["two_scenes_a.png", "two_scenes_b.png"])
    chatbot = page.locator("#chatbot")
    expect(chatbot.locator(".message.user img")).to_have_count(2, timeout=30_000)  # the images, in the history
    expect(page.locator("#stats")).to_contain_text(FINISHED, timeout=120_000)
    expect(page.locator("#stats")).to_contain_text("tok/s")
    answer = chatbot.locator(".message.bot").last
    expect(answer).to_contain_text("tok/s")  # the answer's own summary line
    assert len(answer.inner_text().strip()) > 40
    os.makedirs(SCREENSHOTS, exist_ok=True)
    page.screenshot(path=os.path.join(SCREENSHOTS, "chat.png"), full_page=True)


def test_ab_tab_compares_plain_and_speculative(page):
    from playwright.sync_api import expect

    page.get_by_role("tab", name="A/B").click()
    send(page, "ab-input", "What does this chart show?", ["chart.png"])
    verdict = page.locator("#ab-verdict")
    expect(verdict).to_contain_text("Speedup", timeout=120_000)
    expect(verdict).to_contain_text("identical")
    expect(page.locator("#ab-table")).to_contain_text("Speculative")
    page.screenshot(path=os.path.join(SCREENSHOTS, "ab.png"), full_page=True)
