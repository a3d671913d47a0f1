"""A visitor's conversation and the requests it makes to the engine; no Gradio here.

A `Session` lives in one `gr.State` per browser tab or `gradio_client.Client`, so no answer or
image of one visitor reaches another. It holds the answered turns (images included), the turn
being answered, and the stop flag the Stop button sets.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass

from PIL import Image

from engine.ab import Side
from engine.engine import Engine, RequestError
from engine.images import load_image
from engine.loop import DecodeSettings
from engine.sampling import SamplingSettings
from engine.stats import Stats


@dataclass
class Turn:
    text: str
    files: list[str]  # the uploaded files, shown in the history
    images: list[Image.Image]  # the same files, validated, for the model
    answer: str = ""
    summary: str = ""  # one line of this answer's statistics
    error: str = ""  # why the turn could not be answered; such turns are not sent to the model

    @property
    def message(self) -> dict:
        """The turn as a MultimodalTextbox value (for undo)."""
        return {"text": self.text, "files": list(self.files)}

    def content(self) -> list[dict]:
        text = [{"type": "text", "text": self.text}] if self.text else []
        return [{"type": "image", "image": image} for image in self.images] + text


class Session:
    """Not a dataclass: Gradio serializes a dataclass state value, and an Event cannot be."""

    def __init__(self):
        self.turns: list[Turn] = []
        self.pending: Turn | None = None  # sent by the UI, not answered yet
        self.stop = threading.Event()
        self.plain_tok_s: float | None = None  # the latest plain decode speed seen here ("speedup if known")

    def __deepcopy__(self, memo) -> Session:
        # gr.State copies its initial value for every visitor: each gets a new, empty session.
        return Session()

    def answered(self) -> list[Turn]:
        return [turn for turn in self.turns if not turn.error]

    def num_images(self) -> int:
        return sum(len(turn.images) for turn in self.answered())


@dataclass(frozen=True)
class Options:
    """The settings a request carries; the defaults are the API's (greedy, so deterministic)."""

    mode: str = "speculative"  # or "plain"
    drafter: str | None = None  # a key of engine.drafters; None or "none": the engine's default
    draft_tokens: int = 4
    adaptive: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0
    system_prompt: str = ""
    draft_tree: int = 0  # draft trees of up to this many nodes, draft_tokens deep; 0: chains

    def sampling(self) -> SamplingSettings:
        return SamplingSettings(temperature=float(self.temperature), top_p=float(self.top_p), seed=int(self.seed))

    def decode(self) -> DecodeSettings:
        return DecodeSettings(max_new_tokens=int(self.max_new_tokens), draft_tokens=int(self.draft_tokens),
                              adaptive=bool(self.adaptive), tree_nodes=int(self.draft_tree or 0))

    def drafter_for(self, engine: Engine) -> str | None:
        """The drafter to decode with; None decodes plainly."""
        if self.mode == "plain":
            return None
        if self.mode != "speculative":
            raise RequestError(f"unknown mode {self.mode!r}; use 'speculative' or 'plain'")
        drafter = self.drafter if self.drafter not in (None, "", "none") else engine.default_drafter
        if drafter is None:
            raise RequestError("speculative decoding needs a drafter and none is loaded; choose the plain mode")
        return drafter


def new_turn(message: dict | str | None, engine: Engine, session: Session | None = None) -> Turn:
    """A MultimodalTextbox value ({"text": ..., "files": [...]}) made into a turn whose images
    are validated; RequestError / ImageError name the file or the limit."""
    if isinstance(message, str):
        message = {"text": message, "files": []}
    message = message or {}
    text = (message.get("text") or "").strip()
    files = [_path(file) for file in message.get("files") or []]
    if not text and not files:
        raise RequestError("the message is empty: type a question, add images, or both")
    earlier = session.num_images() if session else 0
    if earlier + len(files) > engine.max_images:
        where = f" ({earlier} earlier in this conversation; start a new chat to free them)" if earlier else ""
        raise RequestError(f"{len(files)} images in this message{where}: the limit is {engine.max_images} "
                           "images per conversation")
    images = [load_image(path, name=os.path.basename(path)) for path in files]
    return Turn(text, files, images)


def _path(file) -> str:
    """A file as Gradio hands it over: a path, or a dict with one (gradio_client, FileData)."""
    if isinstance(file, dict):
        return file.get("path") or file.get("name") or ""
    return getattr(file, "path", file)


def messages_for(session: Session, turn: Turn, system_prompt: str = "") -> list[dict]:
    """The engine's chat messages: system prompt, the answered turns, then `turn`."""
    messages = [{"role": "system", "content": [{"type": "text", "text": system_prompt.strip()}]}] \
        if system_prompt.strip() else []
    for earlier in session.answered():
        messages.append({"role": "user", "content": earlier.content()})
        messages.append({"role": "assistant", "content": [{"type": "text", "text": earlier.answer}]})
    messages.append({"role": "user", "content": turn.content()})
    return messages


def answer(engine: Engine, session: Session, turn: Turn, options: Options) -> Iterator[Side]:
    """Stream the answer to `turn` (the live Side after every chunk) and keep the turn in the
    session's history when it ends: finished, stopped by `session.stop`, or closed by the
    caller (a cancelled request keeps what was answered so far). A request that fails (out of
    memory, say) leaves the history as it was, so the turn can be sent again. A chat cleared
    meanwhile (`session.turns` replaced) does not get the turn."""
    history = session.turns
    events = engine.stream(messages_for(session, turn, options.system_prompt), drafter=options.drafter_for(engine),
                           sampling=options.sampling(), decode=options.decode(), stop=session.stop)
    side, failed = Side(options.mode), False
    try:
        with closing(events):
            for event in events:
                side.update(event)
                yield side
    except Exception:
        failed = True
        raise
    finally:  # GeneratorExit (the caller closed the stream) is not an Exception: the turn is kept
        if side.stats is not None and not failed:
            record(session, turn, side, history)


def record(session: Session, turn: Turn, side: Side, history: list[Turn]) -> None:
    stats = side.stats
    if stats.mode == "plain" and stats.finish_reason != "stopped" and stats.decode_tokens:
        session.plain_tok_s = stats.decode_tok_s
    turn.answer, turn.summary = side.text, summary(stats, session.plain_tok_s)
    history.append(turn)


def summary(stats: Stats, plain_tok_s: float | None = None) -> str:
    """Stats.summary() with the speedup over the latest plain answer, when there is one."""
    line = stats.summary()
    if stats.mode == "speculative" and plain_tok_s:
        first, _, rest = line.partition(" · ")
        line = f"{first} ({stats.decode_tok_s / plain_tok_s:.2f}× plain) · {rest}"
    if stats.finish_reason == "stopped":
        line += " · stopped"
    return line
