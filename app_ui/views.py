"""What the panels show, computed from engine statistics and sessions; plain values only
(strings, lists, dicts, DataFrames), so the Gradio wiring stays thin and this stays testable."""

from __future__ import annotations

import time

import pandas as pd

from app_ui.session import Session, Turn
from engine.ab import ABResult, Side
from engine.stats import Stats

UPDATES_PER_SECOND = 15  # text and statistics; the plots refresh less often
PLOT_UPDATES_PER_SECOND = 2
DRAFT_LABEL = "accepted draft tokens"  # the HighlightedText category of tokens the drafter proposed
FINISH_REASONS = {"stop_token": "end of answer", "max_new_tokens": "max new tokens reached", "stopped": "stopped",
                  "context": "the model's context is full"}


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


def stats_markdown(stats: Stats | None, plain_tok_s: float | None = None) -> str:
    """The live statistics panel: a two-column table."""
    if stats is None:
        return "*Statistics appear here while an answer streams.*"
    rows = _stat_rows(stats)
    if stats.mode == "speculative" and plain_tok_s:
        rows[0] = (rows[0][0], f"{rows[0][1]} ({stats.decode_tok_s / plain_tok_s:.2f}× plain on this question)")
    return _table(["Statistic", "This answer"], rows)


def ab_table(plain: Stats | None, speculative: Stats | None) -> str:
    """Both sides of an A/B run, row by row."""
    if plain is None:
        return ""
    rows = _stat_rows(plain)
    other = _stat_rows(speculative) if speculative else [(name, "") for name, _ in rows]
    return _table(["Statistic", "Plain", "Speculative"], [(name, a, b) for (name, a), (_, b) in zip(rows, other)])


def _stat_rows(stats: Stats) -> list[tuple[str, str]]:
    drafter = f"{stats.drafter_kind}: {_short(stats.drafter)}" if stats.drafter else "none (plain decoding)"
    budget = f", at most {stats.max_image_tokens} per image" if stats.max_image_tokens else ""
    prefill = (f"{stats.prefill_tokens} tokens ({stats.prefill_image_tokens} image{budget}) in "
               f"{stats.prefill_s * 1000:.0f} ms")
    return [
        ("Decode speed", f"**{stats.decode_tok_s:.1f} tok/s**"),
        ("Time to first token", f"{stats.ttft_s * 1000:.0f} ms (images and prompt {stats.prepare_s * 1000:.0f} ms)"),
        ("Prefill", prefill),
        ("Decode", f"{stats.decode_tokens} tokens in {stats.decode_s:.2f} s"),
        ("Whole answer", f"{stats.new_tokens} tokens in {stats.total_s:.2f} s"),
        ("Drafted / accepted", f"{stats.drafted} / {stats.accepted}"),
        ("Acceptance", "—" if stats.acceptance is None else f"{stats.acceptance:.0%}"),
        ("Tokens per target forward", "—" if stats.tokens_per_forward is None else f"{stats.tokens_per_forward:.2f}"),
        ("Draft shape", _draft_shape(stats)),
        ("Mode · drafter", f"{stats.mode} · {drafter}"),
        ("Drafter choice", stats.auto_choice or "—"),
        ("Draft length", stats.draft_length_reason or "—"),
        ("Fell back to plain", stats.fallback_reason or "no"),
        ("Status", FINISH_REASONS.get(stats.finish_reason, "generating…")),
    ]


def _draft_shape(stats: Stats) -> str:
    """Chains, or trees with the nodes verified and the accepted path's depth per target pass."""
    if stats.draft_shape == "tree" and stats.nodes_per_forward is not None:
        return f"tree: {stats.nodes_per_forward:.1f} nodes verified, accepted depth {stats.accepted_depth:.2f} a pass"
    return f"chain (tree asked: {stats.tree_fallback})" if stats.tree_fallback else stats.draft_shape


def _table(header: list[str], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(_cell(value) for value in row) + " |" for row in rows])


def _short(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1]


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def highlighted(side: Side) -> list[tuple[str, str | None]]:
    """The answer in runs of one origin: ("text", DRAFT_LABEL) for accepted draft tokens,
    ("text", None) for the target's own. The runs come decoded with the stream (engine/loop.py),
    so an update costs nothing that grows with the answer."""
    return [(text, DRAFT_LABEL if origin == "draft" else None) for text, origin in side.spans]


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
    """The Chatbot's value: every turn with its images, answer and summary line; the pending
    turn last, with the answer streaming in (`live`)."""
    messages = []
    for turn in session.turns:
        messages += [_user_message(turn), *_assistant_messages(turn)]
    if session.pending is not None:
        messages.append(_user_message(session.pending))
        if live is not None and live.text:
            messages.append({"role": "assistant", "content": live.text})
    return messages


def _user_message(turn: Turn) -> dict:
    return {"role": "user", "content": [{"path": path} for path in turn.files] + ([turn.text] if turn.text else [])}


def _assistant_messages(turn: Turn) -> list[dict]:
    """The answer, then its statistics as a collapsed note of their own (so that the answer's copy
    button copies the answer alone)."""
    if turn.error:
        return [{"role": "assistant", "content": f"**Cannot answer:** {turn.error}"}]
    return [{"role": "assistant", "content": turn.answer},
            {"role": "assistant", "content": turn.summary, "metadata": {"title": f"⚡ {turn.summary}", "status": "done"}}]


def ab_markdown(result: ABResult | None, running: str | None = None) -> str:
    """The A/B verdict: speedup and identity, or which side is running."""
    if result is None:
        return f"*Running the {running} side…*" if running else "*Run a turn to compare plain and speculative decoding.*"
    if result.stopped:
        return "**Stopped** before both sides finished; no speedup or comparison to report."
    parts = []
    if result.decode_speedup is not None:
        parts.append(f"**Speedup {result.decode_speedup:.2f}×** in decode tokens/s")
    if result.time_ratio is not None:
        parts.append(f"whole answer {result.time_ratio:.2f}× as fast")
    if result.identical:
        parts.append("answers **identical** ✓")
    else:
        d = result.first_difference
        parts.append(f"answers **differ** from token {d.index} (character {d.char_index}): "
                     f"plain `{_code(d.plain)}` vs speculative `{_code(d.speculative)}`")
    return " · ".join(parts) + (f"\n\n{result.verdict.text}" if result.verdict else "")


def _code(text: str) -> str:
    return text.replace("`", "'").replace("\n", "⏎") or "(end)"
