"""A visitor's conversation and the requests it makes to the engine; no Gradio here.

A `Session` lives in one `gr.State` per browser tab or `gradio_client.Client`, so no answer or
image of one visitor reaches another. It holds the answered turns (their images shrunk to the
size the model's processor uses), the turn being answered, and what Stop has asked for.

Policies (docs/app.md, "Limits and failures"):
- Stop applies to the request that is running and to any that arrived before it and still wait
  in the queue; a Stop sent while nothing was asked is not kept for the next request.
- A conversation that outgrows the context leaves out its oldest answered turns (their images
  are freed), enough for the new turn and room for its answer; the chat says how many.
- A conversation idle for `Visitors`' limit is emptied, or dropped by Gradio's session store;
  its next message is refused once with a message saying so, and the one after starts a new
  conversation.
- A request runs for at most `time_budget_s` (app_ui/visitors.Limits) per answer it gives (an A/B
  gives four: engine/ab.py's MIN_PAIRS pairs), its images' preparation included: then it stops as
  Stop would, and its answer says "cut at the time budget" (finish reason "time_budget"); images
  still being decoded then are refused by name.
- Images are decoded in the jail's children (engine/image_jail.py, `open_upload`), at most
  `VLM_DECODES_PER_CLIENT` at once for one address; Stop (or New chat) ends a decode in progress
  and starts none. An upload is decoded once (app_ui/uploads.py: kept with it in the ledger).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, field

from PIL import Image

from app_ui.served import Served, served_of
from engine.ab import Side
from engine.backend import Request
from engine.engine import AUTO, ContextError, Engine, RequestError, check_ceilings, check_text
from app_ui.uploads import Ledger, open_upload, return_freed_memory
from engine.image_jail import Stopped
from engine.images import ImageError
from engine.prompt import Prompt
from engine.settings import Settings
from engine.stats import Stats

ANSWER_ROOM = 256  # tokens kept free for the answer when old turns must make way (at most max_new_tokens)


@dataclass
class Turn:
    text: str
    files: list[str]  # the uploaded files, shown in the history
    images: list[Image.Image]  # the same files, validated and shrunk to the processor's size, for the model
    answer: str = ""
    stats: Stats | None = None  # the answer's statistics (the panel beside the chat shows the latest)
    error: str = ""  # why the turn could not be answered; such turns are not sent to the model
    arrived: float = field(default_factory=time.perf_counter)  # when the request arrived (a Stop after it applies)
    load_s: float = 0.0  # time spent opening and shrinking its images, part of the answer's time to first token
    refusal: Exception | None = None  # why its images could not be prepared (the page prepares them apart)
    queue_wait_s: float = 0.0  # from `arrived` to the start of its answer's handler (the wait in Gradio's queue)
    answering: bool = False  # its answer's handler has started (it no longer waits in the queue)
    dropped: int = 0  # the oldest answered turns its prompt left out (Session.dropped when it was answered)
    saved: dict | None = None  # what the visitor's browser keeps of it, once answered (app_ui/browser_chats.py)
    pictures: list[dict] | None = None  # a restored turn's pictures as the browser kept them (name, thumbnail)

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
        self.stop = threading.Event()  # the running request's stop flag (a new one per request)
        self.stopped_at = -math.inf  # time.perf_counter() of the latest Stop
        self.running = False  # a request of this session holds the engine
        self.preparing = False  # the pending turn's images are being decoded (its answer's step comes next)
        self.plain_tok_s: float | None = None  # the plain decode speed of `plain_question`, once measured
        self.plain_question: tuple | None = None  # (text, files) of the latest plain answer
        self.dropped = 0  # the oldest answered turns no longer sent to the model (they outgrew the context)
        self.last_active = time.perf_counter()
        self.expired = False  # emptied for being idle; the next message says so
        self.started = False  # it has held a conversation (a message was accepted)
        self.dropped_by_server = False  # Gradio's store dropped it; the next message says so
        self.time_budget_s: float | None = None  # a request's wall-clock budget (Visitors sets it)
        self.budget_timer: threading.Timer | None = None

    def __deepcopy__(self, memo) -> Session:
        # gr.State copies its initial value for every visitor: each gets a new, empty session.
        return Session()

    def answered(self) -> list[Turn]:
        return [turn for turn in self.turns if not turn.error]

    def kept(self) -> list[Turn]:
        """The answered turns still sent to the model."""
        return self.answered()[self.dropped:]

    def num_images(self) -> int:
        return sum(len(turn.images) for turn in self.kept())

    def files(self) -> set[str]:
        """Every file this conversation shows."""
        turns = self.turns + ([self.pending] if self.pending else [])
        return {path for turn in turns for path in turn.files}

    def is_new(self) -> bool:
        """Nothing was ever said in it."""
        return not (self.started or self.turns or self.pending)

    def begin(self, arrived: float, answers: int = 1, spent: float = 0.0) -> threading.Event:
        """A new stop flag for a request that arrived at `arrived` and gives `answers` answers (an
        A/B two): already set if Stop was pressed since (while the request waited in the queue),
        and set when `answers` x `time_budget_s` runs out, less the `spent` seconds its images took
        (its `reason` is then "time_budget")."""
        self.stop = threading.Event()
        self.stop.reason = "stopped"
        if self.stopped_at >= arrived:
            self.stop.set()
        self.end_budget()
        if self.time_budget_s:
            self.budget_timer = threading.Timer(max(0.0, answers * self.time_budget_s - spent), _out_of_time,
                                                [self.stop])
            self.budget_timer.daemon = True
            self.budget_timer.start()
        return self.stop

    def end_budget(self) -> None:
        if self.budget_timer is not None:
            self.budget_timer.cancel()
            self.budget_timer = None

    def request_stop(self) -> None:
        self.stopped_at = time.perf_counter()
        self.stop.set()

    def stopped_since(self, arrived: float) -> Callable[[], bool]:
        """Whether Stop (or New chat) came after `arrived`: what ends a request's image decodes."""
        return lambda: self.stopped_at >= arrived

    def plain_speed_for(self, turn: Turn) -> float | None:
        """The plain decode speed measured on this turn's question, if it was answered plainly."""
        return self.plain_tok_s if self.plain_question == question_of(turn) else None

    def clear(self) -> None:
        """A new conversation; a running or waiting answer stops and is not kept, and a turn
        waiting for its answer is dropped (so a send failed on the way can never wedge the chat)."""
        self.request_stop()
        self.turns, self.dropped, self.expired, self.pending = [], 0, False, None

    def edit(self, number: int, text: str) -> set[str]:
        """Turn `number`'s question replaced by `text` and sent again, its pictures kept (as
        ChatGPT does): it and every turn after it leave the history, the edited turn is pending.
        Returns the files that no turn shows any more."""
        shown, old = self.files(), self.turns[number]
        del self.turns[number:]
        self.dropped = min(self.dropped, len(self.answered()))
        self.pending = Turn(text, old.files, old.images, pictures=old.pictures)
        return shown - self.files()

    def drop_pending(self) -> set[str]:
        """Drop the turn waiting for its answer (none will come); the files only it showed."""
        turn, self.pending = self.pending, None
        if turn is None:
            return set()
        return set(turn.files) - self.files()

    def expire(self) -> None:
        """Free an idle conversation; its next message is told so."""
        self.clear()
        self.expired = True

    def check_not_expired(self, idle_s: float) -> None:
        """RequestError, once, when the conversation expired (`idle_s`: the idle time that expires
        one) or the server dropped it."""
        if self.dropped_by_server:
            self.dropped_by_server = False
            raise RequestError("the server dropped this conversation to make room for others (too many were open "
                               "at once); send your message again to start a new conversation")
        if self.expired:
            self.expired = False
            idle = f"{idle_s / 60:.0f} minutes" if idle_s >= 120 else f"{idle_s:.0f} seconds"
            raise RequestError(f"this conversation was idle for over {idle} and was cleared to free the server's "
                               "memory; send your message again to start a new conversation")


Options = Settings  # a request's settings: the one schema (engine/settings.py), its defaults the API's


def checked(options: Settings, engine: Engine | Served) -> Settings:
    """The options converted to their types and checked against the schema's ranges and the
    engine's drafters; RequestError names the first setting that is wrong."""
    auto = [AUTO] if engine.drafters else []  # engine/auto.py picks one per request
    options = options.check([*auto, *engine.drafters], engine.context_limit())
    check_ceilings(options.max_new_tokens, options.draft_tokens, options.draft_tree)  # this server's own (VLM_MAX_*)
    return options


def drafter_for(options: Settings, engine: Engine | Served) -> str | None:
    """The drafter to decode with; None decodes plainly."""
    if options.mode == "plain":
        return None
    if options.mode != "speculative":
        raise RequestError(f"mode {options.mode} is not in the list of choices (speculative, plain)")
    drafter = options.drafter if options.drafter not in (None, "", "none") else engine.default_drafter
    if drafter is None:
        raise RequestError("speculative decoding needs a drafter and none is loaded; choose the plain mode")
    return drafter


def new_turn(message: dict | str | None, engine: Engine | Served, session: Session | None = None,
             client: str | None = None, answers: int = 1, alone: bool = False, arrived: float | None = None,
             ledger: Ledger | None = None) -> Turn:
    """A MultimodalTextbox value ({"text": ..., "files": [...]}) made into a turn whose images
    are validated and shrunk to the processor's size in the jail (`open_upload`; `client`: the
    address whose decodes are bounded together); RequestError / ImageError name the file, the
    field or the limit. Checks the text before opening any image. A session's Stop ends the
    decodes (Stopped), and its time budget for `answers` answers bounds them; `alone`: the turn is
    asked without the conversation (an A/B), whose images it does not count; `arrived`
    (time.perf_counter()): when the request came (default: now), a Stop since then applies;
    `ledger`: where each upload's decode is kept (`open_upload`)."""
    started, engine = time.perf_counter(), served_of(engine)
    arrived = started if arrived is None else arrived
    text, files = read_message(message, engine, None if alone else session)
    budget = session.time_budget_s if session is not None else None
    options = {"client": client, "deadline": time.monotonic() + answers * budget if budget else None,
               "cancelled": session.stopped_since(arrived) if session is not None else lambda: False}
    images = [open_upload(path, jail=engine.jail, ledger=ledger, name=os.path.basename(path), **engine.image_fit(),
                          **options) for path in files]
    return Turn(text, files, images, arrived=arrived, load_s=time.perf_counter() - started)


def prepare_images(engine: Served, session: Session, turn: Turn, client: str | None = None,
                   ledger: Ledger | None = None) -> None:
    """Open and shrink `turn`'s images, once (a turn shown at once has its files only): a refusal is
    kept in `turn.refusal` for its answer to report; a Stop meanwhile leaves them unopened (the
    answer then ends as stopped before it started)."""
    if not turn.files or turn.images or turn.refusal is not None:
        return
    session.preparing = True  # neither Stop nor the sweep drops the turn meanwhile: its answer's step comes
    try:
        prepared = new_turn(turn.message, engine, session, client, arrived=turn.arrived, ledger=ledger)
        turn.images, turn.load_s = prepared.images, prepared.load_s
    except Stopped:
        return
    except (RequestError, ImageError) as error:
        turn.refusal = error
    finally:
        session.preparing = False


def read_message(message: dict | str | None, engine: Served, session: Session | None = None) -> tuple[str, list[str]]:
    """The message's (text, file paths), checked without opening any file: RequestError names
    the field or the limit."""
    if isinstance(message, str):
        message = {"text": message, "files": []}
    if message is not None and not isinstance(message, dict):
        raise RequestError(f"message must be {{'text': ..., 'files': [...]}}, got {type(message).__name__}")
    message = message or {}
    text, files = message.get("text") or "", message.get("files") or []
    check_text(text, engine.context_limit())
    if not isinstance(files, list):
        raise RequestError(f"message 'files' must be a list of files, got {type(files).__name__}")
    text, files = text.strip(), list(dict.fromkeys(os.path.abspath(_path(file)) for file in files))  # named twice: one
    if not text and not files:
        raise RequestError("the message is empty: type a question, add images, or both")
    earlier = session.num_images() if session else 0
    if earlier + len(files) > engine.max_images:
        where = f" ({earlier} earlier in this conversation; start a new chat to free them)" if earlier else ""
        raise RequestError(f"{len(files)} images in this message{where}: the limit is {engine.max_images} "
                           "images per conversation")
    return text, files


def _path(file) -> str:
    """A file as Gradio hands it over: a path, or a FileData dict (gradio_client; the Guard lets
    through only the visitor's own uploads and the examples)."""
    if isinstance(file, dict):
        path = file.get("path") or ""
    else:
        path = getattr(file, "path", file)
    if not isinstance(path, str) or not path:
        raise RequestError(f"message 'files' must hold uploaded files, got {file!r}"[:200])
    return path


def messages_for(session: Session, turn: Turn, system_prompt: str = "", dropped: int | None = None) -> list[dict]:
    """The engine's chat messages: system prompt, the answered turns (less the `dropped` oldest;
    default: the session's), then `turn`."""
    messages = [{"role": "system", "content": [{"type": "text", "text": system_prompt.strip()}]}] \
        if system_prompt.strip() else []
    for earlier in session.answered()[session.dropped if dropped is None else dropped:]:
        messages.append({"role": "user", "content": earlier.content()})
        messages.append({"role": "assistant", "content": [{"type": "text", "text": earlier.answer}]})
    messages.append({"role": "user", "content": turn.content()})
    return messages


def fit_to_context(engine: Served, session: Session, turn: Turn, options: Options) -> tuple[Prompt, int]:
    """The prompt for `turn`, and how many of the oldest answered turns it leaves out: as few as
    leave room for the answer (max_new_tokens, at most ANSWER_ROOM). Leaving them out is
    kept (later turns never bring them back) and frees their images. A turn that does not fit
    even alone raises ContextError."""
    history, limit = session.answered(), engine.context_limit()
    room = min(int(options.max_new_tokens), ANSWER_ROOM)
    prompts: dict[int, Prompt | None] = {}

    def fits(dropped: int) -> bool:
        try:
            prompts[dropped] = engine.prepare(messages_for(session, turn, options.system_prompt, dropped),
                                              options.max_image_tokens)
        except ContextError:
            prompts[dropped] = None
            if dropped == len(history):
                raise
            return False
        return not limit or len(prompts[dropped].input_ids) + room <= limit

    low, high = min(session.dropped, len(history)), len(history)
    if not fits(low):
        while low + 1 < high:  # fits(high) is assumed; the first that fits is in (low, high]
            middle = (low + high) // 2
            low, high = (low, middle) if fits(middle) else (middle, high)
        low = high
        if prompts.get(low) is None:
            fits(low)  # raises ContextError when the turn alone is over the context
    for earlier in history[session.dropped:low]:
        earlier.images = []  # no longer sent: free them
    session.dropped = low
    return prompts[low], low


def answer(engine: Engine | Served, session: Session, turn: Turn, options: Options, started: float | None = None
           ) -> Iterator[Side]:
    """Stream the answer to `turn` (the live Side after every chunk) and keep the turn in the
    session's history when it ends: finished, stopped by `session.stop`, or closed by the
    caller (a cancelled request keeps what was answered so far). A request stopped before it
    started, or that fails (out of memory, say), leaves the history as it was, so the turn can
    be sent again. A chat cleared meanwhile (`session.turns` replaced) does not get the turn.
    `started` (time.perf_counter()): when the request started (default: when the visitor sent
    it, `turn.arrived`, so time to first token counts the wait in the queue and the images' loading)."""
    started, engine = turn.arrived if started is None else started, served_of(engine)
    history, stop = session.turns, session.begin(turn.arrived, spent=turn.load_s)
    side, failed = Side(options.mode), False
    session.running = True
    try:
        drafter = None if engine.server_decides else drafter_for(options, engine)
        prompt = None if stop.is_set() or engine.engine is None else fit_to_context(engine, session, turn, options)[0]
        events = engine.backend.stream(Request(
            prompt or messages_for(session, turn, options.system_prompt), drafter, options.sampling(),
            options.decode(), stop, started, options.max_image_tokens))
        with closing(events):
            for event in events:
                side.update(event)
                side.stats.queue_wait_s = turn.queue_wait_s  # the app's queue: part of prepare_s
                yield side
    except Exception:
        failed = True
        raise
    finally:  # GeneratorExit (the caller closed the stream) is not an Exception: the turn is kept
        session.running = False
        if side.stats is not None and side.stats.new_tokens and not failed:
            record(session, turn, side, history)
        return_freed_memory()


def record(session: Session, turn: Turn, side: Side, history: list[Turn]) -> None:
    stats = side.stats
    session.end_budget()
    name_budget_stop(stats, session.stop)
    if stats.mode == "plain" and stats.finish_reason != "stopped" and stats.speed_measured:
        session.plain_tok_s, session.plain_question = stats.decode_tok_s, question_of(turn)
    turn.answer, turn.stats, turn.dropped = side.text, stats, session.dropped
    history.append(turn)


def question_of(turn: Turn) -> tuple:
    """What makes two turns the same question: the text and the files' names."""
    return turn.text, tuple(os.path.basename(path) for path in turn.files)


def name_budget_stop(stats, stop: threading.Event) -> None:
    """An answer (Stats, or None if it never started) that the time budget stopped ends "time_budget", not "stopped"."""
    if stats is not None and stats.finish_reason == "stopped" and getattr(stop, "reason", None) == "time_budget":
        stats.finish_reason = "time_budget"


def _out_of_time(stop: threading.Event) -> None:
    stop.reason = "time_budget"
    stop.set()
