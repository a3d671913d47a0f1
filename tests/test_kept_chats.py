"""app_ui/browser_chats.py without a browser: what a visitor's browser keeps of a chat, its bounds,
a damaged stored value, the exports, and which kept settings a loaded model takes."""

from __future__ import annotations

import json
import os

from app_ui import browser_chats
from app_ui.session import Session, Turn
from engine.stats import Stats
from tests.helpers import EXAMPLES


def answered_turn(text: str, files: list[str] = ()) -> Turn:
    stats = Stats(mode="speculative", new_tokens=12, decode_tokens=11, decode_s=0.5, decode_tok_s=22.0,
                  finish_reason="stop_token", drafted=10, accepted=7, acceptance=0.7)
    return Turn(text, [os.path.join(EXAMPLES, name) for name in files], [], answer="Four shapes.", stats=stats)


def test_a_kept_chat_comes_back_with_its_words_thumbnails_and_statistics():
    turn = answered_turn("Describe the image.", ["scene.png"])
    kept = browser_chats.with_chat(browser_chats.EMPTY, [browser_chats.kept_turn(turn)])
    (chat,) = kept["chats"]
    assert kept["current"] == chat["id"] and chat["title"] == "Describe the image."
    (picture,) = chat["turns"][0]["pictures"]
    assert picture["name"] == "scene.png" and picture["thumbnail"].startswith("data:image/jpeg;base64,")
    assert "22.0 tok/s" in chat["turns"][0]["statistics"] and chat["turns"][0]["stats"]["accepted"] == 7
    session = Session()
    browser_chats.restore(session, json.loads(json.dumps(kept)))  # as the browser hands it back
    (restored,) = session.turns
    assert (restored.text, restored.answer, restored.files, restored.images) == ("Describe the image.",
                                                                                "Four shapes.", [], [])
    table, figures = browser_chats.latest_statistics(session)
    assert "22.0 tok/s" in table and "22.0 tok/s" in figures
    assert browser_chats.answer_statistics(session, 1, {})[0].startswith("**Answer 1 of 1**")


def test_the_store_stays_within_its_bounds_thumbnails_first(monkeypatch):
    turn = browser_chats.kept_turn(answered_turn("A picture", ["chart.png"]))
    one_chat = len(json.dumps(browser_chats.with_chat(browser_chats.EMPTY, [turn])))
    monkeypatch.setattr(browser_chats, "STORED_CHARS", 3 * one_chat)
    kept = browser_chats.EMPTY
    for _ in range(5):
        kept = browser_chats.with_chat({**kept, "current": None}, [json.loads(json.dumps(turn))])
    assert len(json.dumps(kept)) <= 3 * one_chat
    newest, *older = kept["chats"]
    assert newest["turns"][0]["pictures"][0]["thumbnail"]  # the newest keeps its thumbnail
    assert older and all(not p["thumbnail"] for chat in older for t in chat["turns"] for p in t["pictures"])
    assert all(p["name"] == "chart.png" for chat in kept["chats"] for t in chat["turns"] for p in t["pictures"])
    monkeypatch.setattr(browser_chats, "MAX_CHATS", 2)
    assert len(browser_chats.with_chat({**kept, "current": None}, [turn])["chats"]) == 2


def test_a_damaged_value_is_an_empty_list_and_an_emptied_chat_leaves_it():
    for damaged in (None, "text", {"chats": "x"}, {"chats": [1, {"id": "a"}]}):
        assert browser_chats.chats_of(damaged) == {"current": None, "chats": []}
    kept = browser_chats.with_chat(browser_chats.EMPTY, [browser_chats.kept_turn(answered_turn("Hi"))])
    assert browser_chats.with_chat(kept, [])["chats"] == []  # Undo of its only turn
    assert browser_chats.without_current(kept) == {"current": None, "chats": []}


def test_the_exports_name_the_pictures_and_hold_each_answers_statistics():
    turns = [browser_chats.kept_turn(answered_turn("Describe the image.", ["scene.png"])),
             browser_chats.kept_turn(answered_turn("And now?"))]
    kept = browser_chats.with_chat(browser_chats.EMPTY, turns)
    markdown = browser_chats.export(kept, "md")
    assert markdown["name"] == "describe-the-image.md" and markdown["type"] == "text/markdown"
    assert markdown["text"].count("#### Statistics") == 2 and "Pictures: scene.png" in markdown["text"]
    as_json = json.loads(browser_chats.export(kept, "json")["text"])
    assert [turn["stats"]["decode_tok_s"] for turn in as_json["turns"]] == [22.0, 22.0]
    assert browser_chats.export(browser_chats.EMPTY, "md") is None


def test_only_the_settings_the_loaded_model_takes_come_back():
    def check(name, value):
        if name == "drafter" and value not in ("mtp", "auto"):
            raise ValueError(f"no drafter {value}")

    stored = {"drafter": "eagle3", "temperature": 0.5, "unknown": 1, "mode": "plain"}
    assert browser_chats.usable_settings(stored, ["drafter", "temperature", "mode"], check) == {
        "temperature": 0.5, "mode": "plain"}
    assert browser_chats.usable_settings("damaged", ["mode"], check) == {}


def test_an_edited_question_keeps_its_pictures_and_the_turns_after_it_go():
    """Session.edit (the chat's Edit, app_ui/layout.py edit_turn): the edited question is pending
    with its files (a live turn) or its kept thumbnails (a restored one), the later turns leave,
    and the files only they showed are returned for release; kept again, the chat is the edited one.
    An edit while an answer is on its way, or of an index that names no question, is refused."""
    import pytest

    from app_ui.layout import edit_turn
    from engine.engine import RequestError

    session = Session()
    session.turns = [answered_turn("Describe the image.", ["scene.png"]), answered_turn("And this?", ["chart.png"]),
                     answered_turn("Thanks")]
    session.dropped = 2
    freed = session.edit(0, "How many shapes are there?")
    assert session.turns == [] and session.dropped == 0 and freed == {os.path.join(EXAMPLES, "chart.png")}
    assert (session.pending.text, session.pending.files) == ("How many shapes are there?",
                                                             [os.path.join(EXAMPLES, "scene.png")])
    session.turns = [answered_turn("Hi")]
    for index in (0, 1, "0", 2):  # an answer is on its way; then no question there; a script's index; past the end
        with pytest.raises(RequestError):
            edit_turn(None, session, None, index, "Hi", None)
        session.pending = None
    kept = browser_chats.with_chat(browser_chats.EMPTY, [browser_chats.kept_turn(answered_turn("Describe the image.",
                                                                                               ["scene.png"]))])
    restored = Session()
    browser_chats.restore(restored, kept)
    restored.edit(0, "What colour is it?")
    restored.pending.answer, restored.pending.stats = "Red.", answered_turn("x").stats
    restored.turns.append(restored.pending)
    (turn,) = browser_chats.with_chat(kept, [browser_chats.kept_turn(t) for t in restored.turns])["chats"][0]["turns"]
    assert turn["text"] == "What colour is it?" and turn["answer"] == "Red."
    assert turn["pictures"][0]["name"] == "scene.png" and turn["pictures"][0]["thumbnail"].startswith("data:image/jpeg")
