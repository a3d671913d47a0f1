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
from tests.helpers import free_port

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
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def page(url, browser):
    """A desktop window."""
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    page.goto(url)
    yield page
    page.close()


def send(page, box_id: str, text: str, files: list[str]) -> None:
    box = page.locator(f"#{box_id}")
    box.locator("input[type=file]").set_input_files([os.path.join(EXAMPLES, f) for f in files])
    from playwright.sync_api import expect

    expect(box.locator("img")).to_have_count(len(files), timeout=30_000)  # uploaded, thumbnails shown
    box.locator("textarea").fill(text)
    box.locator("textarea").press("Enter")


def test_chat_with_two_images_streams_answer_and_statistics(page):
    from playwright.sync_api import expect

    # A question the bundled model answers right (the screenshot shows it): two purple shapes.
    send(page, "chat-input", "How many purple shapes are there in all the images? Answer in a sentence.",
         ["count_a.png", "count_b.png"])
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
    stop = page.locator("#ab-stop")
    expect(stop).to_be_disabled()  # nothing to stop yet
    send(page, "ab-input", "What does this chart show?", ["chart.png"])
    verdict = page.locator("#ab-verdict")
    expect(verdict).to_contain_text("Speedup", timeout=120_000)
    expect(verdict).to_contain_text("identical")
    expect(page.locator("#ab-table")).to_contain_text("Speculative")
    expect(stop).to_be_disabled()  # grey again once both answers are in
    page.screenshot(path=os.path.join(SCREENSHOTS, "ab.png"), full_page=True)


def test_plain_mode_turns_off_the_drafter_controls(page):
    from playwright.sync_api import expect

    page.get_by_role("tab", name="Chat").click()
    drafter = page.get_by_label("Drafter")
    expect(drafter).to_be_enabled()
    page.get_by_role("radio", name="plain").check()
    expect(drafter).to_be_disabled()
    page.get_by_role("radio", name="speculative").check()
    expect(drafter).to_be_enabled()


def test_retry_with_sampling_takes_the_next_seed(page):
    """At temperature > 0 Retry samples from the next seed (the same seed would repeat the answer)."""
    from playwright.sync_api import expect

    page.get_by_role("tab", name="Chat").click()
    seed = page.get_by_label("Seed (sampling; Retry takes the next)")
    temperature = page.get_by_label("number input for Temperature (0 = greedy)")
    temperature.fill("1")
    temperature.press("Enter")
    temperature.blur()
    before = int(seed.input_value())
    page.locator("#chatbot button[aria-label=Retry]").last.click()
    expect(seed).to_have_value(str(before + 1), timeout=30_000)
    expect(page.locator("#stats")).to_contain_text(FINISHED, timeout=120_000)
    temperature.fill("0")
    temperature.press("Enter")


@pytest.fixture(scope="module")
def phone(url, browser):
    page = browser.new_page(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    page.goto(url)
    yield page
    page.close()


def test_phone_layout_puts_the_chat_first_and_keeps_the_input(phone):
    """390 x 844: the settings sidebar starts closed; the chat, then the folding statistics, then
    the examples; after an answer the message box has the focus again."""
    from playwright.sync_api import expect

    expect(phone.locator(".sidebar.open")).to_have_count(0, timeout=30_000)
    chat, stats = phone.locator("#chatbot").bounding_box(), phone.locator("#stats-section").bounding_box()
    examples = phone.get_by_text("Examples (click, then send)").bounding_box()
    assert chat["y"] < stats["y"] < examples["y"], (chat, stats, examples)
    send(phone, "chat-input", "What does this chart show?", ["chart.png"])
    expect(phone.locator("#stats")).to_contain_text(FINISHED, timeout=120_000)
    expect(phone.locator("#chat-input textarea")).to_be_focused(timeout=10_000)
    expect(phone.locator("#chat-input textarea")).to_be_editable()
    os.makedirs(SCREENSHOTS, exist_ok=True)
    phone.screenshot(path=os.path.join(SCREENSHOTS, "phone.png"), full_page=True)


def test_an_image_dropped_on_the_chat_goes_into_the_message_box(page):
    from playwright.sync_api import expect

    page.get_by_role("tab", name="Chat").click()
    page.locator("#chat-input textarea").fill("")
    with open(os.path.join(EXAMPLES, "card.png"), "rb") as file:
        data = list(file.read())
    page.evaluate("""(data) => {
        const files = new DataTransfer();
        files.items.add(new File([new Uint8Array(data)], 'card.png', { type: 'image/png' }));
        document.querySelector('#chatbot').dispatchEvent(new DragEvent('drop', { dataTransfer: files, bubbles: true }));
    }""", data)
    expect(page.locator("#chat-input img")).to_have_count(1, timeout=30_000)


def test_a_file_that_is_not_an_image_is_taken_out_of_the_box_and_the_text_stays(page, tmp_path):
    from playwright.sync_api import expect

    page.get_by_role("tab", name="Chat").click()
    box = page.locator("#chat-input")
    page.locator("#chat-new").click()  # New chat empties the box too
    expect(box.locator(".thumbnail-item")).to_have_count(0, timeout=30_000)
    fake = tmp_path / "notes.png"
    fake.write_text("not an image at all")
    box.locator("input[type=file]").set_input_files([str(fake)])
    expect(box.locator(".thumbnail-item")).to_have_count(1, timeout=30_000)
    box.locator("textarea").fill("What is this?")
    box.locator("textarea").press("Enter")
    expect(page.get_by_text("notes.png: not an image")).to_be_visible(timeout=30_000)
    expect(box.locator("textarea")).to_have_value("What is this?")
    expect(box.locator(".thumbnail-item")).to_have_count(0, timeout=30_000)
