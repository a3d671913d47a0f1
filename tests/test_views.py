"""What the panels show, from statistics and sides made by the test (no model, no browser)."""

from __future__ import annotations

from app_ui import views
from app_ui.session import Session, Turn
from engine.ab import ABResult, Difference, Side
from engine.stats import Stats


def test_the_highlight_spells_the_final_text_when_the_stream_differs_from_it():
    """A character whose bytes spanned two chunks streams as U+FFFD pieces; the final text is
    decoded whole. The runs follow the final text, keeping each matched character's origin."""
    side = Side("speculative", text="Café au lait.", spans=[("Caf", "target"), ("\ufffd au", "draft"),
                                                             (" lait.", "target")])
    runs = views.highlighted(side)
    assert "".join(text for text, _ in runs) == side.text
    assert (" au", views.DRAFT_LABEL) in runs
    html = views.highlight_html(side)
    assert "\ufffd" not in html and "\n" not in html.split('class="answer-text">')[1]


def test_the_highlight_escapes_markup_and_marks_drafts():
    side = Side("speculative", text="<b>a</b> b", spans=[("<b>a</b>", "draft"), (" b", "target")])
    assert '<mark class="draft">&lt;b&gt;a&lt;/b&gt;</mark> b</div>' in views.highlight_html(side)
    assert views.highlight_html(Side("speculative")) == ""


def test_statistics_speak_plainly():
    """No "1 tokens", no internal drafter name, no bold speed for an answer too short to time;
    rows with nothing to say are left out."""
    one = Stats(mode="speculative", drafter="/models/demo/mtp_drafter", drafter_kind="mtp", new_tokens=2,
                decode_tokens=1, prefill_tokens=1, drafted=1, accepted=1, acceptance=1.0, tokens_per_forward=1.0,
                finish_reason="stop_token")
    text = views.stats_markdown(one)
    assert "1 tokens" not in text and "mtp_drafter" not in text and "MTP head" in text
    assert "**" not in text and "too few tokens to measure" in text
    assert "Drafter choice" not in text and "Fell back" not in text
    plain = views.stats_markdown(Stats(mode="plain", new_tokens=5, decode_tokens=4, finish_reason="stop_token"))
    assert "Acceptance" not in plain and "Accepted / drafted" not in plain


def test_the_first_difference_quotes_both_fragments():
    stats = Stats(decode_tok_s=1.0, total_s=1.0)
    result = ABResult(Side("plain", text="a cat", stats=stats), Side("speculative", text="a dog", stats=stats),
                      decode_speedup=None, time_ratio=None, identical=False,
                      first_difference=Difference(1, 2, "cat", "dog"))
    assert "plain “`cat`” vs speculative “`dog`”" in views.ab_markdown(result)


def test_the_chat_shows_a_sent_message_at_once_and_hints_without_a_picture():
    session = Session()
    session.pending = Turn("Which has more shapes?", ["a.png", "b.png"], [])
    messages = views.chatbot_messages(session, demo=True)
    assert messages[-1]["metadata"]["title"] == "Preparing 2 images…"
    answered = Turn("Hello", [], [], answer="green", summary="9.0 tok/s · TTFT 5 ms · acceptance 50%")
    session.turns, session.pending = [answered], None
    answer, hint, note = views.chatbot_messages(session, demo=True)[1:]
    assert answer["content"] == "green" and "guess" in hint["metadata"]["title"]
    assert note["metadata"]["title"] == "⚡ 9.0 tok/s · TTFT 5 ms" and note["content"] == "- acceptance 50%"
    assert len(views.chatbot_messages(session, demo=False)) == 3
