"""The answer with the tokens the drafter guessed and the target accepted marked green: the runs of
one origin (`highlighted`), rendered from the answer's Markdown as the chat shows it (`highlight_html`)."""

from __future__ import annotations

import html
import re
from difflib import SequenceMatcher

from markdown_it import MarkdownIt

from engine.ab import Side

DRAFT_LABEL = "accepted draft tokens"  # the highlight's category of tokens the drafter proposed
HIGHLIGHT_LEGEND = ('<p class="legend"><strong>{title}</strong>: <mark class="draft">green</mark> tokens the '
                    'drafter guessed and the target accepted; the rest the target wrote itself.</p>')
PLAIN_LEGEND = '<p class="legend"><strong>{title}</strong>: decoded plainly, every token by the target.</p>'
NO_ORIGINS_LEGEND = ('<p class="legend"><strong>{title}</strong>: which tokens were drafted is not reported by '
                     'this server.</p>')


def highlighted(side: Side) -> list[tuple[str, str | None]]:
    """The answer in runs of one origin: ("text", DRAFT_LABEL) for accepted draft tokens,
    ("text", None) for the target's own; the runs spell `side.text` exactly. They come decoded
    with the stream (engine/loop.py), so an update costs nothing that grows with the answer; the
    final text is decoded whole, and where it differs from the streamed runs (a character whose
    bytes spanned two runs), the runs are aligned to it."""
    spans = side.spans
    if "".join(text for text, _ in spans) != side.text:
        spans = _aligned(spans, side.text)
    return [(text, DRAFT_LABEL if origin == "draft" else None) for text, origin in spans]


def _aligned(spans: list[tuple[str, str]], text: str) -> list[tuple[str, str]]:
    """`text` in runs of one origin, each character taking the origin of the streamed character
    it matches (characters with no match: the target's)."""
    streamed = "".join(piece for piece, _ in spans)
    streamed_origins = [origin for piece, origin in spans for _ in piece]
    origins = ["target"] * len(text)
    for a, b, size in SequenceMatcher(None, streamed, text, autojunk=False).get_matching_blocks():
        origins[b:b + size] = streamed_origins[a:a + size]
    runs: list[tuple[str, str]] = []
    for char, origin in zip(text, origins):
        if runs and runs[-1][1] == origin:
            runs[-1] = (runs[-1][0] + char, origin)
        else:
            runs.append((char, origin))
    return runs


# The answer's Markdown rendered as the chat renders it (a line break is a break), its raw HTML,
# links and images shown as text: a model's words never fetch anything or run in the page.
MARKDOWN = MarkdownIt("commonmark", {"html": False, "breaks": True}).disable(["link", "image", "autolink"])
TAG = re.compile(r"(<[^>]*>)")
MATCH_WITHIN = 64  # characters of the answer searched for a shown one (Markdown's own marks lie between)


def marked_markdown(text: str, runs: list[tuple[str, str | None]]) -> str:
    """`text` (spelled by `runs`, highlighted's) rendered from Markdown, each shown character
    marked as its origin in the answer: the answer's characters are walked in order, and each
    shown one takes the next matching one's origin (the `**`, `#` and list marks Markdown turns
    into style are skipped). Marks never cross a tag, and leave out the spaces at their ends."""
    drafted = [label is not None for piece, label in runs for _ in piece]
    shown, position, in_pre = [], 0, 0
    for part in TAG.split(MARKDOWN.render(text)):
        if part.startswith("<"):
            in_pre += part.startswith("<pre") - part.startswith("</pre")
            shown.append(part)
            continue
        if not part or part == "\n" and not in_pre:  # the renderer's line ends between blocks
            continue
        flags = []
        for char in html.unescape(part):
            found = text.find(char, position, position + MATCH_WITHIN)
            flags.append(found >= 0 and drafted[found])
            position = found + 1 if found >= 0 else position
        shown.append(_marks(html.unescape(part), flags))
    return "".join(shown)


def _marks(text: str, drafted: list[bool]) -> str:
    """`text` escaped, its drafted characters' runs in <mark>, each less its leading and trailing spaces."""
    pieces, start = [], 0
    for end in range(1, len(text) + 1):
        if end == len(text) or drafted[end] != drafted[start]:
            piece = text[start:end]
            if drafted[start] and piece.strip():
                core = piece.strip()
                lead, trail = piece[:len(piece) - len(piece.lstrip())], piece[len(piece.rstrip()):]
                pieces.append(f'{html.escape(lead)}<mark class="draft">{html.escape(core)}</mark>{html.escape(trail)}')
            else:
                pieces.append(html.escape(piece))
            start = end
    return "".join(pieces)


def highlight_html(side: Side | None, title: str = "Latest answer") -> str:
    """The answer as the chat shows it (its Markdown rendered), accepted draft tokens marked green,
    under a legend (plain text, not a control). Its characters are the answer's, Markdown's
    marks aside."""
    if side is None or not side.text:
        return ""
    runs = marked_markdown(side.text, highlighted(side))
    origins_known = any(origin != "unknown" for _, origin in side.spans) or not side.spans
    stats = side.stats  # plain decoding where the backend reports it (a server that decides may draft)
    plain = side.mode == "plain" if stats is None else stats.mode == "plain" and "mode" not in stats.unknown
    legend = PLAIN_LEGEND if plain else HIGHLIGHT_LEGEND if origins_known else NO_ORIGINS_LEGEND
    return f'{legend.format(title=title)}<div class="answer-text">{runs}</div>'


def plain_html(text: str) -> str:
    """An answer as running text (the A/B tab's plain side)."""
    return highlight_html(Side("plain", text=text), "Plain")
