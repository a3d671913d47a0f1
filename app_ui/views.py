"""What the panels show, computed from engine statistics and sessions; plain values only
(strings, lists, dicts, DataFrames), so the Gradio wiring stays thin and this stays testable."""

from __future__ import annotations

import re
import time

import pandas as pd

from app_ui.line import Place
from app_ui.session import Session, Turn
from engine.ab import Side
from engine.stats import Stats

UPDATES_PER_SECOND = 15  # text and statistics; the plots refresh less often
PLOT_UPDATES_PER_SECOND = 2
# Plain words for each kind of drafter: "name: what it does" (the settings show the name, then the rest).
DRAFTER_LABELS = {"vlm": "Small VLM: sees the images", "text_lm": "Text-only LM: reads the text, not the images",
                  "ngram": "N-gram lookup: no model, repeats earlier text",
                  "mtp": "MTP head: reads the target's hidden states",
                  "dflash": "Block drafter: a whole draft in one pass",
                  "shared_cache": "Assistant: shares the target's cache",
                  "eagle3": "EAGLE-3 head: reads three of the target's layers"}
NO_PICTURE_HINT = ("The demo model only learned to answer about pictures like the examples (coloured shapes, bar "
                   "charts, text cards); without one, its answer is a guess.")
STOPPED_BEFORE_START = ("**Stopped before it started**: nothing was answered; your message and its images are back "
                        "in the box.")  # the panel after a Stop while the turn waited
NOT_REPORTED = "not reported by this server"  # a statistic the backend cannot measure (Stats.unknown)
FINISH_REASONS = {"stop_token": "end of answer", "max_new_tokens": "max new tokens reached", "stopped": "stopped",
                  "context": "the model's context is full",
                  "time_budget": "cut at the server's time budget"}  # one answer's, or an A/B's (2 x MIN_PAIRS that)


# The note under an answer in the chat that did not end by itself (engine/stats.py finish reasons).
CUT_NOTES = {"stopped": "stopped: the answer ends here", "time_budget": "cut at the server's time budget",
             "context": "cut: the model's context is full",
             "max_new_tokens": "cut at the Max new tokens setting ({tokens}): for more, raise it in the settings "
                               "and press Retry"}


class Throttle:
    """ready() is True at most `per_second` times a second (and always the first time)."""

    def __init__(self, per_second: float):
        self.interval = 1.0 / per_second
        self.last = float("-inf")

    def ready(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.interval:
            return False
        self.last = now
        return True


def stats_dict(stats: Stats | None, dropped_turns: int = 0) -> dict:
    """The API's statistics: always the same keys (Stats' fields plus `summary` and
    `dropped_turns`, the oldest turns of the conversation left out to fit the context)."""
    values = (stats or Stats()).as_dict()
    values = {key: round(value, 4) if isinstance(value, float) else value for key, value in values.items()}
    values["tok_s_curve"] = [round(value, 2) for value in values["tok_s_curve"]]
    return {**values, "summary": stats.summary() if stats else "", "dropped_turns": dropped_turns}


def stats_markdown(stats: Stats | None, plain_tok_s: float | None = None, dropped: int = 0, hint: bool = False,
                   drafters: dict[str, str] | None = None) -> str:
    """The statistics panel beside the chat: a two-column table of the latest answer (`plain_tok_s`:
    the plain speed measured on the same question; `dropped`: the oldest turns left out to fit the
    context; `hint`: the demo model was asked without a picture; `drafters`: key -> kind, for
    naming the drafters in auto's reason as the menu does)."""
    if stats is None:
        return "*Statistics appear here while an answer streams.*"
    rows = _stat_rows(stats)
    ratio = (stats.decode_tok_s / plain_tok_s if stats.mode == "speculative" and plain_tok_s and stats.speed_measured
             else None)
    if ratio is not None:
        rows[0] = (rows[0][0], f"{rows[0][1]} ({ratio:.2f}× plain on this question)")
    named = dict(rows)
    if named.get("Drafter choice"):
        named["Drafter choice"] = auto_choice_text(named["Drafter choice"], drafters or {})
    if named.get("Draft length"):
        named["Draft length"] = _expected_beside_measured(named["Draft length"], ratio)
    if dropped:
        named["Conversation"] = (f"left out the {plural(dropped, 'oldest turn')}: the conversation outgrew the "
                                 "model's context")
    table = _table(["Statistic", "This answer"], [(name, value) for name, value in named.items() if value is not None])
    return (f"ℹ️ {NO_PICTURE_HINT}\n\n" if hint else "") + table


EXPECTED = re.compile(r" \((\d+\.\d+)× plain expected\)")  # the cost rule's estimate in a draft-length reason
PAUSED_EXPECTED = re.compile(r"the best draft length was \d+\.\d+× plain expected")  # engine/draft_length.py


def _expected_beside_measured(reason: str, measured: float | None) -> str:
    """A draft-length reason with the cost rule's expected gain only beside the measured one
    (the speed against plain decoding on this question), or without it."""
    reason = PAUSED_EXPECTED.sub("no draft length was expected to beat plain decoding", reason)
    if measured is None:
        return EXPECTED.sub("", reason)
    return EXPECTED.sub(lambda m: f" ({m.group(1)}× plain expected, {measured:.2f}× measured)", reason)


def auto_choice_text(reason: str, drafters: dict[str, str]) -> str:
    """engine/auto.py's reason with each drafter key (`drafters`: key -> kind) named as the menu
    names it: "auto: Small VLM (... Block drafter 14.9 tok/s ...)", never "auto: vlm"."""
    for key, kind in drafters.items():
        name = drafter_name(kind)
        reason = re.sub(rf"(?<=auto: ){re.escape(key)}(?= \()", name, reason)
        reason = re.sub(rf"(?<=[:,] ){re.escape(key)}(?= [\d.]+ tok/s)", name, reason)
    return reason


def key_figures(stats: Stats | None) -> str:
    """The answer's key figures in one line, the panel's own (the line under Stop on a phone, where
    the panel is below the chat): speed, time to first token, acceptance (speculative only), status."""
    if stats is None:
        return ""
    named = dict(_stat_rows(stats))
    figures = [named["Decode speed"], "first token " + named["Time to first token"].split(" (")[0],
               named["Acceptance"] and f"{named['Acceptance']} accepted", named["Status"]]
    return " · ".join(figure for figure in figures if figure)


def _stat_rows(stats: Stats) -> list[tuple[str, str | None]]:
    """(name, value) rows; None: nothing to say for this answer (the panel leaves the row out).
    What the backend did not report (Stats.unknown) says so, never a made-up figure."""
    rows = _measured_rows(stats)
    unknown = set(stats.unknown)
    if not unknown:
        return rows
    marked = {"Prompt": _prompt_row(stats, unknown), "Decoding": NOT_REPORTED if "mode" in unknown else None}
    for row, fields in UNKNOWN_ROWS.items():
        if fields <= unknown:
            marked[row] = NOT_REPORTED
    return [(name, marked.get(name) or value) for name, value in rows]


# Rows that say "not reported" when the backend reports none of their fields.
UNKNOWN_ROWS = {"Accepted / drafted": {"accepted", "drafted"}, "Acceptance": {"acceptance"},
                "Tokens per target pass": {"tokens_per_forward"}}


def _prompt_row(stats: Stats, unknown: set[str]) -> str:
    tokens = NOT_REPORTED if "prefill_tokens" in unknown else plural(stats.prefill_tokens, "token")
    read = f"{NOT_REPORTED}" if "prefill_s" in unknown else seconds(stats.prefill_s)
    return f"{tokens}; read in: {read}"


def _measured_rows(stats: Stats) -> list[tuple[str, str | None]]:
    speculative = stats.mode == "speculative"
    drafter = drafter_name(stats.drafter_kind) if stats.drafter_kind else "—"
    budget = f", at most {plural(stats.max_image_tokens, 'token')} per image" if stats.max_image_tokens else ""
    images = f" ({plural(stats.prefill_image_tokens, 'token')} for images{budget})" if stats.prefill_image_tokens else ""
    speed = (f"**{stats.decode_tok_s:.1f} tok/s**" if stats.speed_measured else
             "— (too few tokens to measure)" if stats.new_tokens else "—")
    return [
        ("Decode speed", speed),
        ("Time to first token", _first_token_row(stats)),
        ("Prompt", f"{plural(stats.prefill_tokens, 'token')}{images} read in {seconds(stats.prefill_s)}"),
        ("Answer", _answer_row(stats)),
        ("Accepted / drafted", f"{stats.accepted} / {plural(stats.drafted, 'token')}" + (
            f" (approximate: {stats.drafts_approximate})" if stats.drafts_approximate else "") if speculative else None),
        ("Acceptance", None if stats.acceptance is None else f"{stats.acceptance:.0%}"),
        ("Tokens per target pass", None if stats.tokens_per_forward is None else f"{stats.tokens_per_forward:.2f}"),
        ("Draft shape", _draft_shape(stats) if speculative else None),
        ("Decoding", f"speculative · {drafter}" if speculative else "plain"),
        ("Drafter choice", stats.auto_choice),
        ("Draft length", _draft_lengths(stats) if speculative else None),
        ("Fell back to plain", stats.fallback_reason),
        ("Status", FINISH_REASONS.get(stats.finish_reason, (stats.finish_reason or "generating…").replace("_", " "))),
    ]


def _draft_lengths(stats: Stats) -> str | None:
    """The answer's draft lengths over every round (mean and range; the plain steps apart), then why
    the latest round drafted what it did (engine/draft_length.py's words)."""
    drafting = [k for k in stats.draft_lengths if k > 0]
    plain_steps = len(stats.draft_lengths) - len(drafting)
    latest = f"latest round: {stats.draft_length_reason}" if stats.draft_length_reason else None
    if not drafting:
        return latest and f"nothing drafted in this answer; {latest}"
    low, high = min(drafting), max(drafting)
    span = f"always {low}" if low == high else f"{low} to {high}"
    counted = plural(len(drafting), "drafting round") + (f" and {plural(plain_steps, 'plain step')}" if plain_steps else "")
    return f"{sum(drafting) / len(drafting):.1f} on average ({span}) over {counted}" + (f"; {latest}" if latest else "")


def _first_token_row(stats: Stats) -> str:
    """Time to first token and its parts, each named for what the turn had: the wait in line (when
    there was one), preparing the prompt (with its images, when it has any), then the target's
    pass over the prompt that gives the first token."""
    prepared = max(stats.prepare_s - stats.queue_wait_s, 0.0)
    parts = [f"waiting in line {seconds(stats.queue_wait_s)}"] if stats.queue_wait_s >= 0.0005 else []
    parts.append(f"{'images and prompt' if stats.prefill_image_tokens else 'prompt'} prepared in {seconds(prepared)}")
    if "prefill_s" not in stats.unknown:
        parts.append(f"prompt read to the first token in {seconds(stats.prefill_s)}")
    return f"{seconds(stats.ttft_s)} ({' · '.join(parts)})"


def _answer_row(stats: Stats) -> str:
    """The answer's tokens and time; an answer that ended by itself says that its last token is the
    end-of-answer token ("4" is 2 tokens)."""
    ended = ", the last one the end-of-answer token," if stats.finish_reason == "stop_token" else ""
    return (f"{plural(stats.new_tokens, 'token')}{ended} in {seconds(stats.total_s)} "
            f"({plural(stats.decode_tokens, 'token')} after the first, in {seconds(stats.decode_s)})")


def seconds(value: float) -> str:
    """A time in the panel, always in seconds (never ms beside s): 2 decimals, 3 under 0.1 s."""
    return f"{value:.2f} s" if value >= 0.1 else f"{value:.3f} s"


def drafter_name(kind: str | None) -> str:
    """A drafter kind in plain words ("MTP head"), never an internal name or a path."""
    return DRAFTER_LABELS.get(kind, kind or "").split(":")[0]


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _draft_shape(stats: Stats) -> str:
    """Chains, or trees with the nodes verified and the accepted path's depth per target pass."""
    if stats.draft_shape == "tree" and stats.nodes_per_forward is not None:
        return (f"tree: {stats.nodes_per_forward:.1f} draft nodes verified and {stats.accepted_depth:.2f} "
                "accepted per target pass, on average")
    return f"chain (tree asked: {stats.tree_fallback})" if stats.tree_fallback else stats.draft_shape


def _table(header: list[str], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(_cell(value) for value in row) + " |" for row in rows])


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def acceptance_frame(stats: Stats | None) -> pd.DataFrame:
    """Acceptance rate at each draft position (1 = the first drafted token)."""
    drafted = stats.drafted_by_position if stats else []
    accepted = stats.accepted_by_position if stats else []
    return pd.DataFrame({  # positions as labels ("#1"), so the axis never shows 1.5
        "draft position": pd.Series([f"#{i + 1}" for i in range(len(drafted))], dtype=str),
        "acceptance": pd.Series([a / d for a, d in zip(accepted, drafted)], dtype=float),
    })


def speed_frame(points: list[tuple[int, float]]) -> pd.DataFrame:
    """Decode tokens/s against tokens generated so far, one point per chunk."""
    return pd.DataFrame({"tokens": pd.Series([p[0] for p in points], dtype=int),
                         "tok/s": pd.Series([p[1] for p in points], dtype=float)})


def chatbot_messages(session: Session, live: Side | None = None) -> list[dict]:
    """The Chatbot's value: every turn with its images and its answer, one message each (the
    statistics are beside the chat, so an answer has one action row and Copy copies the answer);
    the pending turn last, with the answer streaming in (`live`). Until its first words, Gradio's
    pending dots are the only assistant bubble (the panel says what is being prepared)."""
    messages, dropped = [], 0
    for turn in session.turns:
        messages += [_user_message(turn), _assistant_message(turn, turn.dropped - dropped)]
        dropped = max(dropped, turn.dropped)
    if session.pending is not None:
        messages.append(_user_message(session.pending))
        if live is not None and live.text:
            messages.append({"role": "assistant", "content": live.text})
    return messages


def asked_without_a_picture(session: Session) -> bool:
    """No picture in the conversation so far (the demo model's answers are then a guess)."""
    turns = session.turns + ([session.pending] if session.pending else [])
    return bool(turns) and not any(turn.files for turn in turns)


def preparing(turn: Turn) -> str:
    """The panel while a sent turn waits for its first words."""
    images = len(turn.files)
    return f"*Preparing {plural(images, 'image')}…*" if images and not turn.images else "*Thinking…*"


def waiting(place: Place) -> tuple[str, str]:
    """The panel and the line of key figures while a sent turn waits in line for the engine: its
    place and the wait expected from the answers measured (app_ui/line.py)."""
    ahead = "next in line, after the answer running now" if place.ahead == 1 else \
        f"{plural(place.ahead, 'answer')} ahead of yours (one running, the others waiting)"
    if place.estimate_s is None:
        estimate, short = "no answer measured yet to estimate the wait", ""
    else:
        each = place.estimate_s / max(place.ahead, 1)
        estimate = (f"about {place.estimate_s:.0f} s: the server's last {plural(place.measured_over, 'answer')} took "
                    f"{each:.0f} s each (median)")
        short = f" · about {place.estimate_s:.0f} s"
    return (f"**Waiting in line**: {ahead}; {estimate}. Your message is prepared when its turn comes.",
            f"waiting in line: {place.ahead} ahead{short}")


def _user_message(turn: Turn) -> dict:
    pictures = [kept_pictures(turn.pictures)] if turn.pictures and not turn.files else []
    return {"role": "user", "content": [{"path": path} for path in turn.files] + pictures
            + ([turn.text] if turn.text else [])}


def kept_pictures(pictures: list[dict]) -> str:
    """A restored turn's pictures (app_ui/browser_chats.py): thumbnails where the browser kept
    them, else their names."""
    return " ".join(f"![{p['name']}]({p['thumbnail']})" if p.get("thumbnail") else f"🖼 *{p['name']}*"
                    for p in pictures)


def _assistant_message(turn: Turn, left_out: int = 0) -> dict:
    """An answer, and under it what the panel says of an answer that is not whole: stopped, cut (at
    the Max new tokens setting too, saying how to get more), or given without the `left_out` oldest
    turns (newly left out for this one)."""
    if turn.error:
        return {"role": "assistant", "content": f"**Cannot answer:** {turn.error}"}
    kept = (turn.saved or {}).get("stats") or {}  # a restored turn's, as the browser kept them
    finish, tokens = (turn.stats.finish_reason, turn.stats.new_tokens) if turn.stats else \
        (kept.get("finish_reason"), kept.get("new_tokens") or 0)
    notes = [CUT_NOTES[finish].format(tokens=plural(tokens, "token"))] if finish in CUT_NOTES else []
    if left_out > 0:
        notes.append(f"answered without the {plural(left_out, 'oldest turn')} of this chat: it outgrew the model's context")
    return {"role": "assistant", "content": turn.answer + "".join(f"\n\n*— {note}*" for note in notes)}
