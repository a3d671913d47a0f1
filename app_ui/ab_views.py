"""What the A/B tab shows, from an A/B's progress and result (engine/ab.py): the verdict, the
question it answered, both sides' statistics side by side. Plain values only, as app_ui/views.py."""

from __future__ import annotations

import os

from app_ui.views import _cell, _stat_rows, _table, plural
from engine.ab import MIN_PAIRS, ABProgress, ABResult
from engine.stats import Stats

AB_SIDES = ("plain", "speculative")  # the A/B tab's sides, unless it compares two backends


def ab_table(plain: Stats | None, speculative: Stats | None, names: tuple[str, str] = AB_SIDES) -> str:
    """Both sides of an A/B run, row by row (`names`: the sides' headings)."""
    if plain is None:
        return ""
    rows = _stat_rows(plain)
    other = _stat_rows(speculative) if speculative else [(name, "") for name, _ in rows]
    return _table(["Statistic", *(("Plain", "Speculative") if names == AB_SIDES else names)], [(name, a or "—", b or "—") for (name, a), (_, b)
                                                          in zip(rows, other) if a is not None or b is not None])


def asked(text: str, files: list[str]) -> str:
    """The A/B's question, over its verdict: the message box empties when a run takes it."""
    names = ", ".join(os.path.basename(path) for path in files)
    parts = [f"“{_cell(text)}”" if text else "", f"{plural(len(files), 'image')}: {names}" if files else ""]
    return f"**Asked:** {' · '.join(part for part in parts if part)}\n\n"


def ab_markdown(result: ABResult | None, running: ABProgress | None = None, names: tuple[str, str] = AB_SIDES) -> str:
    """The A/B verdict: speedup and identity, or which side is running (`running`: the progress,
    its side "plain" or "speculative", the first or second; `names`: the sides' names when two backends)."""
    backends = names != AB_SIDES
    if result is None:
        if running and running.pair > 1:
            return (f"*Both answers are in. Timing them again on equal terms: pair {running.pair} of "
                    f"{running.pairs}, the {names[AB_SIDES.index(running.running)]} side…*")
        if running:
            return f"*Running the {names[AB_SIDES.index(running.running)]} side…*"
        return f"*Run a turn to compare {names[0]} and {names[1]}{'' if backends else ' decoding'}.*"
    if result.stopped:
        cut = any(side.stats is not None and side.stats.finish_reason == "time_budget"
                  for side in (result.plain, result.speculative))
        return ((f"**Cut at the server's time budget** (an A/B may take {2 * MIN_PAIRS} times one answer's: it "
                 "answers each side at least twice)" if cut else "**Stopped**")
                + " before both sides finished; no speedup or comparison to report.")
    parts = [_speed_part(result, names)]
    if result.measured and result.time_ratio is not None:
        parts.append(f"whole answer {result.time_ratio:.2f}× as fast")
    if result.identical:
        parts.append("answers **identical** ✓")
    else:
        d = result.first_difference
        unit = "character" if d.index == d.char_index and result.plain.token_ids == [] else "token"
        where = f"{unit} {d.index}" if unit == "character" else f"token {d.index} (character {d.char_index})"
        parts.append(f"answers **differ** from {where}: "
                     f"{names[0]} “`{_code(d.plain)}`” vs {names[1]} “`{_code(d.speculative)}`”")
    return " · ".join(parts) + (f"\n\n{result.verdict.text}" if result.verdict else "")


def _speed_part(result: ABResult, names: tuple[str, str]) -> str:
    """The A/B's speed in a few words: a ratio only where it is a result (engine/ab.py's conventions)."""
    speedup = result.decode_speedup
    if speedup is None:  # Stats.speed_measured: the one rule that the table's "too few tokens to measure" follows
        short = [name for name, side in zip(names, (result.plain, result.speculative))
                 if not (side.stats and side.stats.speed_measured)]
        return f"decode speed ratio **not measurable**: too few tokens to measure on {' and '.join(short)}"
    spread = (f"{result.spread[0]:.2f}× to {result.spread[1]:.2f}× over {result.pairs} alternating pairs"
              if result.pairs > 1 else "1 pair timed")
    if result.impossible:
        return (f"**not a result**: {speedup:.2f}× in decode tokens/s is above the {result.ceiling:.2f}× that the "
                "measured costs allow")
    if not result.measured and names != AB_SIDES:
        return f"**no measurable difference** between {names[1]} and {names[0]} in decode tokens/s ({speedup:.2f}×; {spread})"
    if not result.measured:
        return f"**no measurable difference** in decode tokens/s ({speedup:.2f}×; {spread})"
    if names != AB_SIDES:
        return f"**{names[1]}: {speedup:.2f}×** the decode tokens/s of {names[0]} ({spread})"
    return f"**Speedup {speedup:.2f}×** in decode tokens/s ({spread})"


def _code(text: str) -> str:
    return text.replace("`", "'").replace("\n", "⏎") or "(end)"
