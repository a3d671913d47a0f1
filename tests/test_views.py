"""What the panels show, from statistics and sides made by the test (no model, no browser)."""

from __future__ import annotations

from app_ui import ab_views, highlight, views
from app_ui.session import Session, Turn
from engine.ab import ABResult, Difference, Side
from engine.stats import PAUSED, Stats


def test_the_highlight_spells_the_final_text_when_the_stream_differs_from_it():
    """A character whose bytes spanned two chunks streams as U+FFFD pieces; the final text is
    decoded whole. The runs follow the final text, keeping each matched character's origin."""
    side = Side("speculative", text="Café au lait.", spans=[("Caf", "target"), ("\ufffd au", "draft"),
                                                             (" lait.", "target")])
    runs = highlight.highlighted(side)
    assert "".join(text for text, _ in runs) == side.text
    assert (" au", highlight.DRAFT_LABEL) in runs
    html = highlight.highlight_html(side)
    assert "\ufffd" not in html and "\n" not in html.split('class="answer-text">')[1]


def test_the_highlight_escapes_markup_and_marks_drafts():
    side = Side("speculative", text="<b>a</b> b", spans=[("<b>a</b>", "draft"), (" b", "target")])
    assert '<p><mark class="draft">&lt;b&gt;a&lt;/b&gt;</mark> b</p></div>' in highlight.highlight_html(side)
    assert highlight.highlight_html(Side("speculative")) == ""


def test_the_highlight_renders_markdown_and_marks_words_not_spaces():
    """Issue 60, item 10: no raw `**` (the answer's Markdown is rendered, as the chat renders it,
    each shown character keeping its token's origin); a mark leaves out the spaces at its ends,
    so no thin green sliver between words; links and images stay text."""
    text = "The **cat** sat.\n\n1. First *one*\n2. Second [a](javascript:x) ![i](http://x/i.png)"
    side = Side("speculative", text=text, spans=[("The", "target"), (" **cat**", "draft"), (" sat.", "target"),
                                                  ("\n\n1. First", "draft"), (" ", "draft"),
                                                  (text[text.index(" *one*"):], "target")])
    shown = highlight.highlight_html(side).split('class="answer-text">')[1]
    assert "**" not in shown and '<strong><mark class="draft">cat</mark></strong>' in shown
    assert '<li><mark class="draft">First</mark> <em>one</em></li>' in shown
    assert "<mark class=\"draft\"> " not in shown and " </mark>" not in shown
    assert "<a " not in shown and "<img" not in shown and "[a](javascript:x)" in shown


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
    assert "plain “`cat`” vs speculative “`dog`”" in ab_views.ab_markdown(result)


def test_the_chat_shows_a_sent_message_at_once_and_knows_when_no_picture_was_sent():
    session = Session()
    session.pending = Turn("Which has more shapes?", ["a.png", "b.png"], [])
    assert views.chatbot_messages(session)[-1]["role"] == "user"
    assert "Preparing 2 images…" in views.preparing(session.pending)
    assert not views.asked_without_a_picture(session)
    session.turns, session.pending = [Turn("Hello", [], [], answer="green")], None
    assert views.asked_without_a_picture(session)


def test_one_answer_is_one_message_and_a_pending_turn_adds_none():
    """The statistics are beside the chat (the panel), never a chat message of their own with its
    own Copy / Retry / Undo; while a turn is prepared, Gradio's pending dots are the only
    assistant bubble."""
    session = Session()
    session.turns = [Turn("Hello", [], [], answer="green")]
    session.pending = Turn("Which has more shapes?", ["a.png"], [])
    messages = views.chatbot_messages(session)
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1] == {"role": "assistant", "content": "green"}
    assert not any("metadata" in m for m in messages)
    assert "Preparing 1 image…" in views.preparing(session.pending)


def test_the_no_picture_hint_is_beside_the_chat():
    stats = Stats(mode="plain", new_tokens=3, decode_tokens=2, decode_s=0.1, decode_tok_s=20.0)
    assert views.NO_PICTURE_HINT in views.stats_markdown(stats, hint=True)
    assert views.NO_PICTURE_HINT not in views.stats_markdown(stats)


def test_a_speed_is_given_only_where_it_is_measured():
    """One rule for the panel, the one-line summary and the A/B: an answer of one token (or two
    when the speed could not be timed) has no decode speed, never "17.8 tok/s" or "0.0 tok/s"."""
    short = Stats(mode="speculative", new_tokens=2, decode_tokens=1, decode_s=0.056, decode_tok_s=17.8, ttft_s=0.1)
    one = Stats(mode="plain", new_tokens=1, decode_tokens=0, decode_tok_s=0.0, ttft_s=0.1)
    for stats in (short, one):
        assert not stats.speed_measured
        assert "tok/s" not in stats.summary() and "too few tokens" in stats.summary()
        assert "too few tokens to measure" in views.stats_markdown(stats)


def test_a_ratio_with_a_missing_side_reads_not_measurable():
    """Built-in against llama.cpp on a one-character answer: neither decode speed is measured, so
    there is no decode ratio (it once read "0.00× the decode tokens/s")."""
    from engine.ab import compare

    plain = Side("plain", text="A", done=True, stats=Stats(new_tokens=2, decode_tokens=1, decode_s=0.01,
                                                          decode_tok_s=100.0, total_s=0.2, finish_reason="stop_token"))
    other = Side("speculative", text="A", done=True, stats=Stats(new_tokens=1, decode_tokens=0, decode_s=0.0,
                                                                decode_tok_s=0.0, total_s=0.05,
                                                                finish_reason="stop_token"))
    result = compare(None, plain, other, verdict_of=False)
    assert result.decode_speedup is None
    text = ab_views.ab_markdown(result, names=("built-in", "llama.cpp"))
    assert "0.00" not in text and "not measurable" in text
    assert "too few tokens" in text


def test_plain_decoding_shows_no_speculative_labels():
    side = Side("plain", text="a cat", spans=[("a cat", "target")],
                stats=Stats(mode="plain", new_tokens=3, decode_tokens=2))
    html = highlight.highlight_html(side)
    assert "drafter" not in html and "green" not in html and "a cat" in html


def test_auto_explains_its_choice_with_the_menus_names():
    from engine.auto import DrafterChooser

    chooser = DrafterChooser(["vlm", "dflash"])
    chooser.record("vlm", 1, 20, 30.0)
    chooser.record("dflash", 1, 20, 14.9)
    _, reason = chooser.choose(1)
    stats = Stats(mode="speculative", drafter_kind="vlm", auto_choice=reason, new_tokens=3, decode_tokens=2)
    text = views.stats_markdown(stats, drafters={"vlm": "vlm", "dflash": "dflash"})
    assert "Small VLM" in text and "Block drafter 14.9 tok/s" in text and "request" not in text  # no counts
    assert "auto: vlm" not in text and "dflash" not in text


def test_an_expected_speedup_is_not_shown_alone():
    """The cost rule's expected gain is its own estimate, not a measurement: the panel shows the
    draft length's reason without it ("draft length 6: ... (7.00× plain expected)" once sat
    beside a measured 0.39×)."""
    stats = Stats(mode="speculative", new_tokens=9, decode_tokens=8, decode_s=0.1, decode_tok_s=80.0,
                  draft_length_reason="draft length 6: the fastest at the measured costs and acceptance "
                                      "(7.00× plain expected)")
    text = views.stats_markdown(stats)
    assert "7.00" not in text and "draft length 6" in text
    assert "7.00× plain expected, 2.00× measured" in views.stats_markdown(stats, plain_tok_s=40.0)
    stats.draft_length_reason = f"{PAUSED}; the best draft length was 0.80× plain expected; 1 token is tried again"
    assert "0.80" not in views.stats_markdown(stats) and "expected to beat plain" in views.stats_markdown(stats)


def test_every_figure_has_its_unit():
    """"the model's context (2,048 tokens) takes at most 32,768" once left the reader to guess."""
    import pytest

    from engine.engine import RequestError
    from engine.settings import check_text

    with pytest.raises(RequestError, match=r"takes at most 32,768 characters"):
        check_text("x" * 40_000, 2048)
    stats = Stats(mode="speculative", prefill_tokens=40, prefill_image_tokens=16, max_image_tokens=256,
                  drafted=5, accepted=3, new_tokens=4, decode_tokens=3)
    text = views.stats_markdown(stats)
    assert "16 tokens for images, at most 256 tokens per image" in text and "3 / 5 tokens" in text


def test_time_to_first_token_is_split_into_what_the_turn_had():
    """"Time to first token 4754 ms (images and prompt 3997 ms)" on a turn without images, the wait
    in the queue inside: now the wait, the preparation (images named only when the prompt has
    some) and the prompt's pass, each on its own."""
    waited = Stats(mode="plain", ttft_s=4.754, prepare_s=4.117, queue_wait_s=3.997, prefill_s=0.637)
    row = dict(views._stat_rows(waited))["Time to first token"]
    assert row == ("4.75 s (waiting in line 4.00 s · prompt prepared in 0.12 s · prompt read to the first token "
                   "in 0.64 s)")
    assert "images" not in row
    pictured = Stats(mode="plain", ttft_s=0.9, prepare_s=0.3, prefill_s=0.6, prefill_image_tokens=64)
    row = dict(views._stat_rows(pictured))["Time to first token"]
    assert row.startswith("0.90 s (images and prompt prepared in 0.30 s") and "waiting" not in row
    assert views.key_figures(pictured).split(" · ")[1] == "first token 0.90 s"


def test_times_are_in_seconds_and_a_finished_answer_counts_its_end_token():
    """Issue 60, item 10: "ms" beside "s" in one panel; "Answer 2 tokens" for "4", the end token unexplained."""
    four = Stats(mode="plain", new_tokens=2, decode_tokens=1, total_s=0.05, decode_s=0.012, ttft_s=0.038,
                 prefill_s=0.03, finish_reason="stop_token")
    text = views.stats_markdown(four)
    assert " ms" not in text and "0.038 s" in text
    assert "2 tokens, the last one the end-of-answer token, in 0.050 s (1 token after the first, in 0.012 s)" in text
    assert "end-of-answer" not in views.stats_markdown(Stats(mode="plain", new_tokens=2, finish_reason="max_new_tokens"))


def test_the_place_in_line_and_the_wait_expected_are_said():
    from app_ui.line import Place

    panel, figures = views.waiting(Place(ahead=3, estimate_s=12.0, measured_over=5))
    assert "3 answers ahead of yours" in panel and "about 12 s" in panel and "last 5 answers took 4 s each" in panel
    assert figures == "waiting in line: 3 ahead · about 12 s"
    panel, _ = views.waiting(Place(ahead=1, estimate_s=None, measured_over=0))
    assert "next in line" in panel and "no answer measured yet" in panel


def test_a_cut_or_stopped_answer_says_so_in_the_chat():
    """Only the panel once said "stopped", "cut at the server's time budget" or "left out the 2
    oldest turns": the answer in the chat looked finished."""
    session = Session()
    finished = Turn("Hi", [], [], answer="Hello.", stats=Stats(finish_reason="stop_token"))
    stopped = Turn("Tell a story", [], [], answer="Once", stats=Stats(finish_reason="stopped"))
    cut = Turn("More", [], [], answer="And", stats=Stats(finish_reason="time_budget"), dropped=2)
    later = Turn("Again", [], [], answer="So.", stats=Stats(finish_reason="stop_token"), dropped=2)
    session.turns = [finished, stopped, cut, later]
    answers = [m["content"] for m in views.chatbot_messages(session) if m["role"] == "assistant"]
    assert answers[0] == "Hello." and answers[3] == "So."  # whole, and nothing newly left out
    assert answers[1] == "Once\n\n*— stopped: the answer ends here*"
    assert "cut at the server's time budget" in answers[2] and "without the 2 oldest turns" in answers[2]
    long = Turn("Explain", [], [], answer="First,", stats=Stats(finish_reason="max_new_tokens", new_tokens=40))
    restored = Turn("Explain", [], [], answer="First,", saved={"stats": {"finish_reason": "max_new_tokens",
                                                                           "new_tokens": 40}})
    session.turns = [long, restored]
    answers = [m["content"] for m in views.chatbot_messages(session) if m["role"] == "assistant"]
    assert answers[0] == answers[1] == ("First,\n\n*— cut at the Max new tokens setting (40 tokens): for more, raise it "
                                        "in the settings and press Retry*")


def test_the_draft_length_row_covers_the_whole_answer():
    """"draft length 7: the fastest at the measured costs and acceptance" beside an answer whose
    acceptance was 10 %, and "1" beside 3.11 tokens a pass: the row now gives every round's length."""
    stats = Stats(mode="speculative", new_tokens=30, decode_tokens=29, decode_s=1.0, decode_tok_s=29.0,
                  draft_lengths=[4, 7, 0, 7, 1], draft_length_reason="draft length 1: the fastest at ...")
    row = dict(views._stat_rows(stats))["Draft length"]
    assert row.startswith("4.8 on average (1 to 7) over 4 drafting rounds and 1 plain step; latest round: "
                          "draft length 1")
    assert dict(views._stat_rows(Stats(mode="plain")))["Draft length"] is None
