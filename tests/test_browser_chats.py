"""Chats kept in the visitor's own browser (app_ui/browser_chats.py), in Debian's Chromium driven
by Playwright against a real server on the bundled demo model: a reload keeps the conversation,
its statistics and the settings; another browser profile sees none of them; the list switches,
starts and deletes chats; the exports hold the statistics. Screenshots of the chat list and the
tooltips go to artifacts/screenshots/ (desktop 1440x900, dark mode, phone 390x844)."""

from __future__ import annotations

import json
import os
import time
import re

import pytest

import app
from models.presets import DEMO_MODEL
from tests.conftest import ROOT
from tests.helpers import CHROMIUM, free_port, send

SCREENSHOTS = os.path.join(ROOT, "artifacts", "screenshots")
FINISHED = re.compile("end of answer|max new tokens reached")
DESKTOP = {"width": 1440, "height": 900}

pytestmark = [
    pytest.mark.skipif(not os.path.exists(CHROMIUM),
                       reason=f"{CHROMIUM} is missing: install Debian's chromium (scripts/test.sh does)"),
    pytest.mark.skipif(not os.path.isdir(DEMO_MODEL), reason=f"the bundled demo model ({DEMO_MODEL}) is missing"),
]


@pytest.fixture(scope="module")
def url():
    demo = app.main(["--preset", "demo", "--port", str(free_port()), "--host", "127.0.0.1", "--no-browser"],
                    block=False)
    yield demo.local_url
    demo.close()


@pytest.fixture(scope="module")
def profile(url, browser):
    """One browser profile (its own localStorage), kept across the module's tests."""
    context = browser.new_context(viewport=DESKTOP)
    yield context
    context.close()


@pytest.fixture(scope="module")
def page(url, profile):
    page = profile.new_page()
    page.goto(url)
    page.locator("#chat-input textarea").wait_for()
    yield page
    page.close()


def answered(page, count: int) -> None:
    from playwright.sync_api import expect

    expect(page.locator("#chatbot .message.bot")).to_have_count(count, timeout=120_000)
    expect(page.locator("#chat-stop")).to_be_disabled(timeout=120_000)  # the answer has ended
    expect(page.locator("#stats")).to_contain_text(FINISHED)
    expect(page.locator("#chat-list label")).not_to_have_count(0, timeout=30_000)  # kept: listed


def test_a_reload_keeps_the_chat_its_statistics_and_the_settings(page):
    from playwright.sync_api import expect

    max_new = page.get_by_label("number input for Max new tokens")
    max_new.fill("40")
    max_new.press("Enter")
    send(page, "chat-input", "What does this chart show?", ["chart.png"])
    answered(page, 1)
    answer = page.locator("#chatbot .message.bot").first.inner_text().strip()
    speed = re.search(r"[\d.]+ tok/s", page.locator("#stats").inner_text()).group(0)
    cut = "max new tokens reached" in page.locator("#stats").inner_text()  # the demo's answer is longer: cut
    assert not cut or answer.endswith("— cut at the Max new tokens setting (40 tokens): for more, raise it in the "
                                      "settings and press Retry"), answer
    page.reload()
    page.locator("#chat-input textarea").wait_for()
    chatbot = page.locator("#chatbot")
    expect(chatbot.locator(".message.user").last).to_contain_text("What does this chart show?", timeout=30_000)
    expect(chatbot.locator(".message.user img")).to_have_count(1)  # the thumbnail the browser kept
    expect(chatbot.locator(".message.bot")).to_have_text(answer)  # its note too, from the statistics kept
    expect(page.locator("#stats")).to_contain_text(speed)
    expect(page.locator("#chat-figures")).to_contain_text(speed)
    expect(page.get_by_label("number input for Max new tokens")).to_have_value("40")
    expect(page.locator("#chat-list label")).to_have_count(1)
    expect(page.locator("#chat-list label")).to_contain_text("What does this chart show?")
    expect(page.locator("#picture-hint")).to_be_visible()  # the demo's picture limit, beside a picture


def test_every_statistics_row_explains_itself(page):
    """Each row of the panel has words for a chat user (components.ROW_HELP), shown when pointed at;
    no raw setting name in the sidebar's help."""
    from playwright.sync_api import expect

    from app_ui.components import ROW_HELP
    from app_ui.views import _stat_rows
    from engine.stats import Stats

    assert {name for name, _ in _stat_rows(Stats(mode="speculative"))} <= set(ROW_HELP)
    rows = page.locator("#stats td:first-child")
    expect(rows.first).to_have_attribute("data-help", ROW_HELP["Decode speed"], timeout=30_000)
    assert all(rows.nth(i).get_attribute("data-help") for i in range(rows.count()))
    page.locator("#stats td", has_text="Tokens per target pass").hover()
    os.makedirs(SCREENSHOTS, exist_ok=True)
    page.screenshot(path=os.path.join(SCREENSHOTS, "tooltip-desktop.png"))
    sidebar = page.locator(".sidebar").inner_text()
    assert not re.search(r"\b[a-z]+_[a-z_]+\b", sidebar), sidebar  # draft_tokens, max_new_tokens...
    page.locator("#what-is-this").get_by_text("What is this?").click()  # folded: one line until opened
    expect(page.locator("#what-is-this")).to_contain_text("drafter", timeout=10_000)


def test_another_profile_sees_none_of_it(url, browser):
    from playwright.sync_api import expect

    context = browser.new_context(viewport=DESKTOP)
    other = context.new_page()
    other.goto(url)
    other.locator("#chat-input textarea").wait_for()
    expect(other.locator("#chatbot .placeholder-content")).to_be_visible(timeout=30_000)
    expect(other.locator("#chatbot .message")).to_have_count(0)
    expect(other.locator("#chat-list label")).to_have_count(0)
    expect(other.get_by_label("number input for Max new tokens")).not_to_have_value("40")
    expect(other.locator("#picture-hint")).to_be_hidden()
    context.close()


def test_the_exports_hold_the_chat_and_its_statistics(page):
    answer = page.locator("#chatbot .message.bot").first.inner_text().strip().split("\n\n— cut")[0]  # its note apart
    with page.expect_download() as markdown:
        page.locator("#export-md").click()
    text = open(markdown.value.path(), encoding="utf-8").read()
    assert markdown.value.suggested_filename.endswith(".md")
    assert "What does this chart show?" in text and "Pictures: chart.png" in text
    assert answer.split()[0] in text and "#### Statistics" in text and "tok/s" in text
    with page.expect_download() as as_json:
        page.locator("#export-json").click()
    chat = json.loads(open(as_json.value.path(), encoding="utf-8").read())
    (turn,) = chat["turns"]
    assert turn["text"] == "What does this chart show?" and turn["pictures"][0]["name"] == "chart.png"
    assert turn["answer"].strip() == answer and turn["stats"]["new_tokens"] > 0
    assert turn["stats"]["finish_reason"] in ("stop_token", "max_new_tokens")


def test_the_list_opens_starts_and_deletes_chats_and_each_answer_keeps_its_statistics(page):
    from playwright.sync_api import expect

    page.locator("#chat-new").click()
    expect(page.locator("#chatbot .message")).to_have_count(0, timeout=30_000)
    page.locator("#chatbot .example").first.click()
    answered(page, 1)
    send(page, "chat-input", "Read the text in the image.", ["card.png"])
    answered(page, 2)
    chats = page.locator("#chat-list label")
    expect(chats).to_have_count(2)
    expect(chats.first).to_contain_text("Describe the image.")  # the newest first
    page.locator("#chatbot .message.bot").first.click()  # an earlier answer: its own statistics
    expect(page.locator("#stats")).to_contain_text("Answer 1 of 2")
    os.makedirs(SCREENSHOTS, exist_ok=True)
    page.screenshot(path=os.path.join(SCREENSHOTS, "chats-desktop.png"))
    chats.nth(1).click()  # the first chat again
    expect(page.locator("#chatbot .message.bot")).to_have_count(1, timeout=30_000)
    expect(page.locator("#chatbot .message.user").last).to_contain_text("What does this chart show?")
    page.locator("#chat-delete").click()
    expect(chats).to_have_count(1, timeout=30_000)
    expect(page.locator("#chatbot .message")).to_have_count(0)
    page.reload()
    expect(page.locator("#chat-list label")).to_have_count(1, timeout=30_000)


def test_an_empty_send_does_nothing_and_a_chosen_file_leaves_the_focus_in_the_box(url, browser):
    """Issue 60, item 10: Enter in an empty box shows no error toast; after a file is chosen the focus
    is in the message box; the footer has no "Runs" link (Gradio's run history is not the chat)."""
    from playwright.sync_api import expect

    from tests.helpers import EXAMPLES

    context = browser.new_context(viewport=DESKTOP)
    page = context.new_page()
    page.goto(url)
    box = page.locator("#chat-input")
    box.locator("textarea").press("Enter")
    box.locator("textarea").press("Enter")
    page.locator("#chat-new").focus()
    box.locator("input[type=file]").set_input_files([os.path.join(EXAMPLES, "card.png")])
    expect(box.locator("textarea")).to_be_focused(timeout=30_000)
    expect(box.locator("img")).to_have_count(1, timeout=30_000)
    box.locator("textarea").fill("Read the text in the image.")
    box.locator("textarea").press("Enter")
    answered(page, 1)
    expect(page.locator(".toast-body")).to_have_count(0)  # the empty sends said nothing
    expect(page.get_by_role("link", name="Runs")).to_have_count(0)
    context.close()


def test_an_earlier_question_is_edited_from_the_keyboard_answered_again_and_kept(url, browser):
    """Issue 60, item 12 (as ChatGPT and Open WebUI do): Edit on the first of two questions, with
    the keyboard only (Esc cancels, Enter sends): the edited question keeps its picture, the turns
    after it go, it is answered again, and the chat kept in the browser is the edited one."""
    from playwright.sync_api import expect

    context = browser.new_context(viewport=DESKTOP)
    page = context.new_page()
    page.goto(url)
    page.locator("#chat-input textarea").wait_for()
    chatbot = page.locator("#chatbot")
    send(page, "chat-input", "What does this chart show?", ["chart.png"])
    answered(page, 1)
    send(page, "chat-input", "Read the text in the image.", ["card.png"])
    answered(page, 2)
    edit = chatbot.locator("button[aria-label=Edit]").first
    assert edit.get_attribute("tabindex") != "-1"
    edit.focus()
    page.keyboard.press("Enter")
    editing = chatbot.locator("textarea")
    expect(editing).to_be_focused()
    expect(editing).to_have_value("What does this chart show?")
    page.keyboard.press("Escape")  # cancelled: nothing changes
    expect(editing).to_have_count(0)
    expect(chatbot.locator(".message.bot")).to_have_count(2)
    edit.focus()
    page.keyboard.press("Enter")
    page.keyboard.press("Control+A")
    page.keyboard.type("Which bar is the tallest?")
    page.keyboard.press("Enter")
    expect(chatbot.locator(".message.user")).to_have_count(2, timeout=30_000)  # the picture, the words
    expect(chatbot.locator(".message.user").last).to_have_text("Which bar is the tallest?")
    expect(chatbot.locator(".message.user img")).to_have_count(1)
    answered(page, 1)
    expect(chatbot).not_to_contain_text("Read the text in the image.")
    answer = chatbot.locator(".message.bot").first.inner_text().strip()
    os.makedirs(SCREENSHOTS, exist_ok=True)
    page.screenshot(path=os.path.join(SCREENSHOTS, "edited-desktop.png"))
    page.reload()
    expect(chatbot.locator(".message.bot")).to_have_count(1, timeout=30_000)
    expect(chatbot.locator(".message.bot")).to_have_text(answer)
    expect(chatbot.locator(".message.user").last).to_have_text("Which bar is the tallest?")
    expect(chatbot.locator(".message.user img")).to_have_count(1)  # its thumbnail, kept
    expect(page.locator("#chat-list label")).to_have_count(1)
    expect(page.locator("#chat-list label")).to_contain_text("Which bar is the tallest?")
    expect(chatbot.locator("button[aria-label=Edit]:visible")).to_have_count(1)  # the words; not the thumbnails
    context.close()


def settled_box(page, selector: str, timeout: float = 5.0) -> dict:
    """The element's bounding box once the sidebar's slide has ended (the same box twice, 100 ms apart)."""
    box, deadline = None, time.monotonic() + timeout
    while time.monotonic() < deadline:
        page.wait_for_timeout(100)
        now = page.locator(selector).bounding_box()
        if now == box:
            break
        box = now
    return box


def test_screenshots_of_the_chat_list_in_dark_mode_and_on_a_phone(url, browser, profile):
    from playwright.sync_api import expect

    dark_profile = browser.new_context(viewport=DESKTOP, color_scheme="dark", storage_state=profile.storage_state())
    dark = dark_profile.new_page()
    dark.goto(url + "?__theme=dark")
    expect(dark.locator("#chat-list label")).to_have_count(1, timeout=30_000)
    dark.locator("#chat-list label").first.click()
    expect(dark.locator("#chatbot .message.bot")).to_have_count(2, timeout=30_000)
    dark.locator("#stats td", has_text="Acceptance").first.hover()
    dark.screenshot(path=os.path.join(SCREENSHOTS, "chats-dark.png"))
    dark_profile.close()
    phone_profile = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True,
                                        storage_state=profile.storage_state())
    phone = phone_profile.new_page()
    phone.goto(url)
    phone.locator("#chat-input textarea").wait_for()
    expect(phone.locator("#header p")).to_be_visible()  # the model line, on a phone too
    phone.locator(".sidebar .toggle-button").click()
    expect(phone.locator("#chat-list label")).to_have_count(1, timeout=30_000)
    toggle = settled_box(phone, ".sidebar .toggle-button")  # whole on the screen (once cut in half)
    assert toggle["x"] >= 0 and toggle["x"] + toggle["width"] <= 390, toggle
    assert phone.evaluate("""() => { const arrow = document.querySelector('#chatbot .scroll-down-button-container');
        const z = (e) => +getComputedStyle(e).zIndex;  // the chat's arrow stays under the open sidebar
        return !arrow || z(arrow) < z(document.querySelector('.sidebar')); }""")
    phone.locator("#chat-list label").first.click()
    expect(phone.locator("#chatbot .message.bot")).to_have_count(2, timeout=30_000)
    phone.screenshot(path=os.path.join(SCREENSHOTS, "chats-phone.png"))
    phone.locator(".sidebar .toggle-button").click()
    phone.locator("#stats td", has_text="Draft length").first.tap()
    phone.screenshot(path=os.path.join(SCREENSHOTS, "tooltip-phone.png"), full_page=True)
    phone_profile.close()
