"""Chats kept in the visitor's own browser (its localStorage, through Gradio's gr.BrowserState),
never on the server: a reload keeps the conversation, each answer's statistics and the settings;
a list of past chats to switch to, start or delete; export as Markdown or JSON.

What the browser keeps (`KEPT_CHATS`' value), plain JSON:

    {"current": "c1733..." | None,            # the chat on screen (None: a new one, not kept yet)
     "chats": [{"id", "title", "updated",     # newest first, at most MAX_CHATS
                "turns": [{"text", "pictures": [{"name", "thumbnail"}], "answer", "error",
                           "statistics", "figures", "stats"}]}]}

`statistics` is the panel's table for that answer, `figures` its one line, `stats` the API's
dictionary (views.stats_dict). A picture is a small JPEG thumbnail (a data: URL), or its name
alone once the chats outgrow STORED_CHARS (the oldest chats' thumbnails go first). A restored
chat goes on with its words: the model no longer sees its pictures (the server kept none).

Gradio encrypts the stored value with `SECRET`, which the page itself receives: it hides the
chats from a casual look at the storage, not from the visitor's own browser, whose data they are.
A fixed secret (not Gradio's per-process random one) keeps the chats across server restarts.
"""

from __future__ import annotations

import base64
import io
import json
import os
import time

from PIL import Image

from app_ui import views
from app_ui.session import Turn

CHATS_KEY, SETTINGS_KEY = "vlm-chat-chats", "vlm-chat-settings"  # localStorage keys
SECRET = "vlm-chat-kept-in-this-browser"  # see the module's docstring: obscures, does not protect
EMPTY = {"current": None, "chats": []}
MAX_CHATS = 30
STORED_CHARS = 1_500_000  # localStorage holds about 5 M characters per site; Gradio's encryption adds a third
THUMBNAIL_PX = 96
TITLE_CHARS = 48


def picture(path: str) -> dict:
    """A file as the browser keeps it: its name and a small JPEG thumbnail ("" if it cannot be read)."""
    name = os.path.basename(path)
    try:
        with Image.open(path) as image:
            image.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
            buffer = io.BytesIO()
            image.convert("RGB").save(buffer, "JPEG", quality=70)
    except (OSError, ValueError):
        return {"name": name, "thumbnail": ""}
    return {"name": name, "thumbnail": "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()}


def kept_turn(turn: Turn, drafters: dict[str, str] | None = None) -> dict:
    """What the browser keeps of an answered (or refused) turn; made once, then reused
    (`drafters`: key -> kind, to name auto's choice as the menu does)."""
    if turn.saved is None:
        stats = turn.stats
        pictures = turn.pictures if turn.pictures is not None else [picture(path) for path in turn.files]
        turn.saved = {"text": turn.text, "pictures": pictures, "answer": turn.answer,
                     "error": turn.error,
                     "statistics": views.stats_markdown(stats, drafters=drafters) if stats else "",
                     "figures": views.key_figures(stats), "stats": views.stats_dict(stats) if stats else None}
    return turn.saved


def restored_turn(kept: dict) -> Turn:
    """A kept turn back in a session: its words (the model reads them again), no pictures."""
    pictures = [p for p in kept.get("pictures") or [] if isinstance(p, dict) and p.get("name")]
    turn = Turn(str(kept.get("text") or ""), [], [], answer=str(kept.get("answer") or ""),
                error=str(kept.get("error") or ""), pictures=pictures)
    turn.saved = kept
    return turn


def title_of(turns: list[dict]) -> str:
    """The first question's words (or its pictures' names), shortened."""
    for kept in turns:
        words = " ".join(kept.get("text", "").split()) or ", ".join(p["name"] for p in kept.get("pictures", []))
        if words:
            return words if len(words) <= TITLE_CHARS else words[:TITLE_CHARS - 1].rstrip() + "…"
    return "Chat"


def chats_of(kept) -> dict:
    """The browser's value, or EMPTY when it holds nothing usable (another version's, a damaged one)."""
    if not isinstance(kept, dict) or not isinstance(kept.get("chats"), list):
        return {"current": None, "chats": []}
    chats = [chat for chat in kept["chats"] if isinstance(chat, dict) and isinstance(chat.get("turns"), list)
             and chat.get("id")]
    current = kept.get("current") if any(chat["id"] == kept.get("current") for chat in chats) else None
    return {"current": current, "chats": chats}


def current_chat(kept) -> dict | None:
    chats = chats_of(kept)
    return next((chat for chat in chats["chats"] if chat["id"] == chats["current"]), None)


def with_chat(kept, turns: list[dict]) -> dict:
    """The browser's value with the chat on screen (`turns`) kept as the newest (a new chat gets
    an id); a chat emptied (Undo) leaves the list. Then within MAX_CHATS and STORED_CHARS."""
    chats = chats_of(kept)
    if not turns:
        return without_current(chats)
    current = chats["current"] or f"c{time.time_ns()}"
    chat = {"id": current, "title": title_of(turns), "updated": time.time(), "turns": turns}
    others = [other for other in chats["chats"] if other["id"] != current]
    return _within_bounds({"current": current, "chats": [chat, *others][:MAX_CHATS]})


def _within_bounds(chats: dict) -> dict:
    """The oldest chats' thumbnails dropped (their names stay) until the value fits STORED_CHARS;
    then the oldest chats, the one on screen last."""
    for chat in reversed(chats["chats"]):
        if len(json.dumps(chats)) <= STORED_CHARS:
            return chats
        for kept in chat["turns"]:
            kept["pictures"] = [{"name": p["name"], "thumbnail": ""} for p in kept.get("pictures", [])]
    while len(json.dumps(chats)) > STORED_CHARS and len(chats["chats"]) > 1:
        chats["chats"].pop()
    return chats


def without_current(kept) -> dict:
    """The browser's value less the chat on screen (a new, empty one is on screen then)."""
    chats = chats_of(kept)
    return {"current": None, "chats": [chat for chat in chats["chats"] if chat["id"] != chats["current"]]}


def choices(kept) -> list[tuple[str, str]]:
    """The chat list's (label, id), newest first."""
    return [(chat.get("title") or "Chat", chat["id"]) for chat in chats_of(kept)["chats"]]


def export_markdown(chat: dict) -> str:
    """A chat as Markdown: each question (its pictures named), each answer with its statistics."""
    lines = [f"# {chat.get('title') or 'Chat'}", "",
             f"*Exported from VLM chat (speculative decoding), {_when(chat.get('updated'))}.*", ""]
    for number, kept in enumerate(chat.get("turns", []), 1):
        names = ", ".join(p["name"] for p in kept.get("pictures", []))
        lines += [f"## {number}. You", "", kept.get("text") or "", *(["", f"Pictures: {names}"] if names else []),
                  "", "### Answer", ""]
        if kept.get("error"):
            lines += [f"**Cannot answer:** {kept['error']}", ""]
            continue
        lines += [kept.get("answer") or "", ""]
        if kept.get("statistics"):
            lines += ["#### Statistics", "", kept["statistics"], ""]
    return "\n".join(lines)


def export_json(chat: dict) -> str:
    """A chat as JSON: the kept turns (pictures with their thumbnails, each answer's statistics)."""
    return json.dumps({"title": chat.get("title"), "exported_from": "VLM chat", "updated": _when(chat.get("updated")),
                       "turns": chat.get("turns", [])}, indent=1, ensure_ascii=False)


def export(kept, kind: str) -> dict | None:
    """{"name", "type", "text", "at"} for the page to download (kind "md" or "json"); None: no chat."""
    chat = current_chat(kept)
    if chat is None:
        return None
    stem = "".join(c if c.isalnum() else "-" for c in chat.get("title", "chat").lower()).strip("-")[:40] or "chat"
    text, media = (export_markdown(chat), "text/markdown") if kind == "md" else (export_json(chat), "application/json")
    return {"name": f"{stem}.{kind}", "type": media, "text": text, "at": time.time()}


def _when(seconds) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(float(seconds)))
    except (TypeError, ValueError):
        return "date unknown"


# --- The page's events (app_ui/layout.py wires them) ------------------------------------------


def latest_statistics(session) -> tuple[str, str]:
    """(the panel's table, the key figures' line) of the session's latest answer, from what was kept."""
    answered = [turn for turn in session.turns if turn.saved and turn.saved.get("statistics")]
    if not answered:
        return views.stats_markdown(None), ""
    return answered[-1].saved["statistics"], answered[-1].saved.get("figures") or ""


def answer_statistics(session, index: int, drafters: dict[str, str]) -> tuple[str, str]:
    """The panel for the answer shown as chat message `index` (or its question): "Answer 2 of 3"
    over that answer's statistics; the latest answer's when the index names none."""
    turns = [turn for turn in session.turns if turn.stats is not None or (turn.saved and turn.saved.get("statistics"))]
    number = index // 2 if isinstance(index, int) else -1
    if not 0 <= number < len(session.turns) or session.turns[number] not in turns:
        return latest_statistics(session)
    saved = kept_turn(session.turns[number], drafters)
    place = turns.index(session.turns[number]) + 1
    return f"**Answer {place} of {len(turns)}** (click an answer for its statistics)\n\n{saved['statistics']}", \
        saved["figures"]


def restore(session, kept) -> None:
    """The browser's chat on screen into a session that holds nothing (a reload, a switch)."""
    chat = current_chat(kept)
    if chat is not None:
        session.turns = [restored_turn(saved) for saved in chat["turns"] if isinstance(saved, dict)]
        session.started = bool(session.turns)


def usable_settings(kept_settings, names: list[str], check) -> dict:
    """Of the settings the browser kept, those the loaded model takes (`check(name, value)` raises
    ValueError for one it does not: another model's drafter, a value out of range)."""
    usable = {}
    for name, value in (kept_settings.items() if isinstance(kept_settings, dict) else ()):
        if name in names:
            try:
                check(name, value)
            except (ValueError, TypeError):
                continue
            usable[name] = value
    return usable
