"""The callbacks behind the page's events and the API (app_ui/layout.py wires them): each gets
what the app serves (`served`, app_ui/served.py) and the visitor's Session explicitly.

Events that generate share the concurrency group `GENERATE` with a limit of 1: one generation
per loaded model at a time, the others wait in Gradio's queue and see their place in it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from contextlib import contextmanager

import gradio as gr

from app_ui import ab_views, highlight, queue_rules, views
from app_ui.components import ab_names
from app_ui.line import place
from app_ui.served import Served, served_of
from app_ui.session import (Options, Session, Turn, answer, checked, drafter_for, messages_for, name_budget_stop,
                            new_turn, open_upload, prepare_images, question_of, read_message)
from app_ui.stop_lane import leave_queue
from app_ui.visitors import Visitors
from engine.ab import MIN_PAIRS, ABProgress, run_ab
from engine.backend import Backend
from engine.engine import Engine, RequestError
from engine.image_jail import OutOfTime
from engine.images import ImageError

logger = logging.getLogger(__name__)

GENERATE = {"concurrency_id": "generate", "concurrency_limit": 1}


@contextmanager
def user_errors():
    """Request problems reach the user as gr.Error naming the file or limit; anything else is
    logged and reported as an internal error, never as a bare exception."""
    try:
        yield
    except (RequestError, ImageError) as error:
        raise gr.Error(str(error), print_exception=False) from None
    except gr.Error:
        raise
    except Exception as error:
        logger.exception("request failed")
        raise gr.Error(f"internal error: {type(error).__name__}: {error}") from error


def _without_named_files(message: dict, error: str) -> dict:
    """The message less the files that an ImageError names (its message starts with the file's name)."""
    files = [path for path in message["files"] if not error.startswith(os.path.basename(path) + ":")]
    return {"text": message["text"], "files": files}


def is_empty(message) -> bool:
    """A message box's value with no text (or only spaces) and no file."""
    return isinstance(message, dict) and not str(message.get("text") or "").strip() and not message.get("files")


def number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


async def _stop(session: Session, request: gr.Request, visitors: Visitors) -> None:
    """Stop the session's running answer, and let its answers still waiting in Gradio's queue
    run at once (each sees the stop, ends without an answer and puts its message back in the
    box: a turn it moved is theirs to give back, so it is never dropped here); a turn accepted whose answer
    neither waits nor runs (its respond step never came) is dropped, its files freed."""
    session.request_stop()
    moved = await leave_queue(request, request.session_hash)  # each runs now and gives its message back
    blocks = _blocks_of(request)
    if not moved and session.pending is not None and not (session.running or session.preparing) and blocks is not None \
            and request.session_hash not in queue_rules.sessions(blocks, GENERATE["concurrency_id"]):
        visitors.release(session, session.drop_pending())


def stopper(visitors: Visitors):
    """The Stop buttons' callback."""
    async def stop(session: Session, request: gr.Request) -> None:
        await _stop(session, request, visitors)
    return stop


def _blocks_of(request: gr.Request | None):
    """The Blocks serving `request`, or None (a test calling the handler)."""
    app = getattr(getattr(request, "request", None), "app", None)
    return app.get_blocks() if hasattr(app, "get_blocks") else None


def check_queue(request: gr.Request | None, visitors: Visitors) -> None:
    """RequestError when an answer of this session, from this address, may not join the queue
    now (app_ui/queue_rules.py: one waiting per conversation, a few per address), and when the
    bounds cannot be checked: no queue to read, or no address (the Guard stamps one on every request)."""
    blocks = _blocks_of(request)
    client = client_of(request)
    if blocks is None or client is None:
        raise RequestError(f"the server cannot check its queue's bounds for this request (no "
                           f"{'queue' if blocks is None else 'client address'}); it is refused")
    try:
        refusal = queue_rules.refusal(blocks, GENERATE["concurrency_id"], request.session_hash, client,
                                      visitors.limits.answers_per_client)
    except queue_rules.QueueUnreadable as error:
        logger.error("%s", error)
        raise RequestError("the server cannot check its queue's bounds now, so it takes no answers; try later") \
            from None
    if refusal:
        raise RequestError(refusal)


def clear(session: Session, visitors: Visitors) -> None:
    """A new conversation; a running or waiting answer stops and is not kept; every upload the
    old conversation sent is deleted (unless another conversation holds it), shown or not."""
    session.clear()
    visitors.release(session)


def next_seed(seed):
    """The seed after `seed`, wrapping at 2**63; no change (gr.skip) when `seed` is not a whole
    number from 0 to 2**63 - 1: the answer then names it."""
    if isinstance(seed, (int, float)) and not isinstance(seed, bool) and math.isfinite(seed) and seed == int(seed) \
            and 0 <= seed < 2**63:
        return (int(seed) + 1) % 2**63
    return gr.skip()


def claim(visitors: Visitors, session: Session, files: list[str], request: gr.Request | None) -> None:
    """The session holds `files` now; RequestError names one that is not the visitor's own upload
    (the Guard refuses those before Gradio reads the request; this holds without it too)."""
    state = getattr(getattr(request, "request", None), "state", None)
    refused = visitors.claim(session, files, getattr(state, "visitor", None))
    if refused is not None:
        raise RequestError(f"{os.path.basename(refused)}: not a file you uploaded to this server; upload it again")


def client_of(request: gr.Request | None) -> str | None:
    """The request's client address (stamped by visitors.Guard), else None (a test calling the handler)."""
    return getattr(getattr(getattr(request, "request", None), "state", None), "client", None)


def arrival(request: gr.Request | None) -> float:
    """When the request reached the server (stamped by visitors.Guard), else now."""
    state = getattr(getattr(request, "request", None), "state", None)
    return getattr(state, "arrived", None) or time.perf_counter()


def start(session: Session, turn: Turn) -> None:
    session.pending = turn


def refused_files(served: Served, message, checked: dict[str, str | None], keep: int = 512,
                  client: str | None = None, ledger: Visitors | None = None):
    """{"paths": [...]} of the message's files that are not usable images, each named in a notice
    (ImageError's words), or gr.skip() when there are none; `checked`: path -> the refusal (None:
    fine), so that typing reopens nothing (the oldest entries go beyond `keep`). Each is decoded in
    the jail (engine/image_jail.py), among `client`'s decodes, and kept in `ledger` for the send."""
    refused = []
    for file in (message or {}).get("files") or []:
        path = file.get("path") if isinstance(file, dict) else getattr(file, "path", file)
        if not isinstance(path, str):
            continue
        if path not in checked:
            try:
                open_upload(path, jail=served.jail, ledger=ledger, **served.image_fit(), client=client)
                checked[path] = None
            except ImageError as error:
                checked[path] = str(error)
                gr.Warning(f"{error}. It is taken out of the message box; your text stays.")
            while len(checked) > keep:
                checked.pop(next(iter(checked)))
        if checked.get(path):
            refused.append(path)
    return {"paths": refused, "at": time.time()} if refused else gr.skip()


def respond(served: Engine | Served, session: Session, options: Options | dict, demo_model: bool = False,
            ledger: Visitors | None = None):
    """Prepare the pending turn's images, then stream its answer into the chat panels (and,
    last, the message box), throttled; plots less often. A refused turn (an unreadable image, a
    prompt too long for the context) goes back into the message box, less a refused file, with
    the reason in a notice; the conversation is unchanged. A turn stopped before its answer started
    (while it waited in the queue) goes back into the box, text and images, and the panel says so;
    one that failed is shown with the reason. A chat cleared meanwhile gets empty panels. `options`
    as sent (a dict: the page sends them unprocessed), checked here: a bad one is refused like a
    bad image, and the turn is cleared whatever fails; a refused turn's decodes leave `ledger`."""
    turn, history, served = session.pending, session.turns, served_of(served)
    if turn is None:
        return
    began = time.perf_counter()
    turn.queue_wait_s, turn.answering = began - turn.arrived, True
    text_tick, plot_tick = views.Throttle(views.UPDATES_PER_SECOND), views.Throttle(views.PLOT_UPDATES_PER_SECOND)
    side, points, returned, stopped_early = None, [], gr.skip(), False
    plain_tok_s = session.plain_speed_for(turn)
    kinds = {key: drafter.kind for key, drafter in served.drafters.items()}

    def statistics(stats):
        hint = demo_model and views.asked_without_a_picture(session)
        return views.stats_markdown(stats, plain_tok_s, session.dropped, hint, kinds)

    try:
        options = checked(Options(**options) if isinstance(options, dict) else options, served)
        if session.stopped_at < turn.arrived:  # else Stop came while it waited: nothing to prepare
            prepare_images(served, session, turn)  # the page's prepare step did, outside the answer slot
            if turn.refusal is not None:
                raise turn.refusal
            for side in answer(served, session, turn, options):
                if side.stats.decode_tokens:
                    points.append((side.stats.new_tokens, round(side.stats.decode_tok_s, 2)))
                if side.text and session.turns is history and text_tick.ready():
                    plots = plot_tick.ready()
                    yield panels(views.chatbot_messages(session, side), side, statistics(side.stats),
                                  points if plots else None) + (gr.skip(),)
        if (side is None or not side.stats.new_tokens) and session.turns is history:
            returned, stopped_early = turn.message, True  # stopped before it started: nothing kept
    except (RequestError, ImageError) as error:
        if ledger is not None:
            ledger.decodes.forget(*turn.files)
        returned = _without_named_files(turn.message, str(error))
        kept = "your text stays" if len(returned["files"]) < len(turn.files) else "your message is back in the box"
        gr.Warning(f"Cannot answer: {error} ({kept}).")
    except Exception as error:
        logger.exception("generation failed")
        turn.error = f"generation failed ({type(error).__name__}: {error}); the conversation is kept, try again"
        history.append(turn)
    finally:
        session.pending = None
        if not stopped_early:
            served.answer_times.record(time.perf_counter() - began)
    messages = views.chatbot_messages(session)
    if session.turns is not history:  # New chat while it ran: the stopped answer is not shown
        yield panels(messages) + (returned,)
    elif stopped_early:
        yield panels(messages, statistics=views.STOPPED_BEFORE_START)[:-1] + (views.STOPPED_BEFORE_START, returned)
    elif side is None or not side.text:  # nothing answered: the panels keep the latest answer
        latest = session.answered()[-1].stats if session.answered() else None
        skipped = [gr.skip()] * (len(panels([])) - 3)  # the highlight, plots and their column stay
        yield (messages, statistics(latest) if latest else views.stats_markdown(None), *skipped,
               views.key_figures(latest), returned)
    else:
        yield panels(messages, side, statistics(side.stats), points) + (returned,)


def line_panel(served: Served, session: Session, request: gr.Request | None):
    """The panel and the key figures while the session's sent turn waits in line (app_ui/line.py),
    and the timer that asks again: stopped once the turn's answer has started or the turn is gone."""
    turn = session.pending
    if turn is None or turn.answering:
        return gr.skip(), gr.skip(), gr.Timer(active=False)
    where = place(_blocks_of(request), GENERATE["concurrency_id"], getattr(request, "session_hash", None),
                  served.answer_times)
    if where is None:  # not in line (yet, or any more): the panel says what it said
        return gr.skip(), gr.skip(), gr.skip()
    return *views.waiting(where), gr.skip()


def shown_waiting(session: Session) -> tuple:
    """A sent turn's panels until its answer's first words: what is prepared, no earlier answer's
    highlight or plots (they would read as this one's), and the timer that shows the place in line."""
    panel = views.preparing(session.pending)
    return panel, "", gr.Column(visible=False), panel, gr.Timer(active=True)


def prepare(served: Served, session: Session, request: gr.Request | None = None, ledger: Visitors | None = None
            ) -> None:
    """The page's step between showing a message and answering it: its images decoded in the jail
    (or taken from `ledger`, where the check when they were attached left them), outside the answer
    slot (GENERATE), so that a slow or hostile image holds no visitor's answer; a refusal is
    reported by the answer step."""
    if session.pending is not None:
        prepare_images(served, session, session.pending, client_of(request), ledger)


def decoded_before(request: gr.Request | None) -> float:
    """The seconds the request's uploads took to decode before it joined the line (the Guard's
    `prepare`; 0 when they were not), part of its time budget; OutOfTime when the budget ran out
    then (they are not decoded again in the answer's slot)."""
    state = getattr(getattr(request, "request", None), "state", None)
    refusal = getattr(state, "images_refused", None)
    if refusal:
        raise OutOfTime(refusal)
    return getattr(state, "images_s", 0.0) or 0.0


def panels(messages: list[dict], side=None, statistics: str | None = None,
            points: list[tuple[int, float]] | None = ()) -> tuple:
    """The chat panels' values: chat, statistics (views.stats_markdown's text; None: the empty
    panel's), highlight, the two plots (points None: left as they are), the column holding
    the last three (shown once there is an answer) and the key figures' line (a phone's, under Stop)."""
    stats = side.stats if side else None
    if points is None:
        plots = (gr.skip(), gr.skip())
    else:
        drafted = bool(stats and stats.drafted)
        speed_max = max([10] + [tokens for tokens, _ in points])
        plots = (gr.update(value=views.acceptance_frame(stats), visible=drafted),
                 gr.update(value=views.speed_frame(list(points)), x_lim=[0, speed_max]))
    return (messages, statistics or views.stats_markdown(None), highlight.highlight_html(side), *plots,
            gr.Column(visible=bool(side and side.text)), views.key_figures(stats))


def api_chat(served: Served, message_value, session: Session, options: Options, arrived: float,
              visitors: Visitors, session_id: str | None = None, request: gr.Request | None = None):
    """/chat: (answer text, statistics dict), streamed; the turn joins the session's history. A
    request stopped while it waited in the queue answers "" with finish_reason "stopped"."""
    waited, tick = time.perf_counter() - arrived, views.Throttle(views.UPDATES_PER_SECOND)
    with user_errors():
        session.check_not_expired(visitors.limits.idle_s)
        options = checked(options, served)
        before = decoded_before(request)
        turn = new_turn(message_value, served, session, client_of(request), arrived=arrived, ledger=visitors)
        turn.queue_wait_s, turn.load_s = waited, turn.load_s + before
        claim(visitors, session, turn.files, request)
        visitors.spoke(session, session_id)
        try:
            for side in answer(served, session, turn, options):
                if tick.ready():
                    yield side.text, _public_stats(served, side.stats, session.dropped)
        except (RequestError, ImageError):  # refused (a shape the processor refuses, say): its pixels serve nothing
            visitors.decodes.forget(*turn.files)
            raise
    served.answer_times.record(time.perf_counter() - arrived - waited)
    yield side.text, _public_stats(served, side.stats, session.dropped)


def _public_stats(served: Served, stats, dropped: int) -> dict:
    """views.stats_dict, the drafter named by its key (e.g. "text"), never by the folder it was loaded from
    (`queue_wait_s`: from the send to the answer's start, part of `prepare_s` and `ttft_s`)."""
    values = views.stats_dict(stats, dropped)
    keys = {getattr(drafter, "name", key): key for key, drafter in served.drafters.items()}
    values["drafter"] = keys.get(values["drafter"], values["drafter"] and os.path.basename(str(values["drafter"])))
    return values


def _ab_events(served: Served, message_value, session: Session, options: Options, arrived: float,
               ab_backend: Backend | None, request: gr.Request | None = None, ledger: Visitors | None = None):
    """run_ab on one message (no chat history), with a stop flag that Stop sets (also while the
    request waits in the queue); against `ab_backend` when there is one; its uploads from `ledger`
    where the Guard decoded them before it joined the line."""
    options = checked(options, served)
    before, client = decoded_before(request), client_of(request)
    if served.server_decides and ab_backend is None:
        raise RequestError(f"the server at {served.name} decides its own decoding, so there is no plain and "
                           "speculative run to compare; start the app with --ab-backend URL to compare it with "
                           "another backend")
    turn = new_turn(message_value, served, session, client, answers=2, alone=True, arrived=arrived, ledger=ledger)
    turn.load_s += before
    messages = messages_for(Session(), turn, options.system_prompt)
    drafter = drafter_for(options, served) if served.drafters else None  # run_ab says why None cannot do
    stop, session.running, began = session.begin(arrived, answers=2 * MIN_PAIRS, spent=turn.load_s), True, time.perf_counter()
    try:
        for event in run_ab(served.backend, messages, drafter, options.sampling(), options.decode(), stop,
                            options.max_image_tokens, against=ab_backend):
            if not isinstance(event, ABProgress) and event.stopped:  # ab_markdown says why
                for side in (event.plain, event.speculative):
                    name_budget_stop(side.stats, stop)
            if not isinstance(event, ABProgress) and not event.stopped and event.plain.stats.speed_measured:
                session.plain_tok_s, session.plain_question = event.plain.stats.decode_tok_s, question_of(turn)
            yield event
    finally:
        session.running = False
        session.end_budget()
        served.answer_times.record(time.perf_counter() - began)


def ab_live(served: Served, message_value, session: Session, options: Options, arrived: float,
             ab_backend: Backend | None, request: gr.Request | None = None, ledger: Visitors | None = None):
    tick, names = views.Throttle(views.UPDATES_PER_SECOND), ab_names(served, ab_backend)
    with user_errors():
        asked = ab_views.asked(*read_message(message_value, served))
        for event in _ab_events(served, message_value, session, options, arrived, ab_backend, request, ledger):
            done = not isinstance(event, ABProgress)
            if done or tick.ready():
                verdict = asked + ab_views.ab_markdown(event if done else None, None if done else event, names)
                first = (highlight.plain_html(event.plain.text) if ab_backend is None
                         else highlight.highlight_html(event.plain, names[0]))
                yield (verdict, first, highlight.highlight_html(event.speculative, "Speculative" if ab_backend is None else names[1]),
                       ab_views.ab_table(event.plain.stats, event.speculative.stats, names))


def api_ab(served: Served, message_value, session: Session, options: Options, arrived: float,
           ab_backend: Backend | None, request: gr.Request | None = None, ledger: Visitors | None = None):
    """/ab: plain answer, speculative answer, speedup, identical, first difference (or None);
    stopped: speedup, identical and first difference are None."""
    with user_errors():
        *_, result = _ab_events(served, message_value, session, options, arrived, ab_backend, request, ledger)
    difference = result.as_dict()["first_difference"]
    identical = None if result.identical is None else json.dumps(result.identical)  # gr.JSON reads "true"
    return result.plain.text, result.speculative.text, result.decode_speedup, identical, difference
