"""Who may queue answers, and in what order they run, read from Gradio's queue.

Events of the concurrency group that generates (callbacks.GENERATE: one answer at a time) wait in
one list. Unchecked, one visitor could fill it (200 answers from one session) and every other
visitor would wait behind them all. So, before Gradio queues an answer (`refusal`, called by
the Guard): a conversation may have one answer waiting, an address `Limits.answers_per_client`
waiting or running. And after each answer joins (`interleave`), the waiting list is put in turns
by address: every address's first waiting answer before any address's second, so a visitor
waits for at most one answer of each other address, not for all of one address's answers. An
answer whose images are being decoded before it joins the line (app_ui/prepare_lane.py, the lane
PREPARING) counts as waiting.

It uses Gradio's queue internals (gradio/queueing.py: `Queue.event_queue_per_concurrency_id`,
`EventQueue.queue` and `current_concurrency`, `Queue.active_jobs`, `Event.session_hash`, `Event._id`,
`Event.request`), read for
Gradio 6, as app_ui/stop_lane.py does; an event's address is the one the Guard stamped on its
request (`scope["state"]["client"]`). Each is read as an attribute, never with a default: a
field Gradio renamed raises QueueUnreadable, the Guard then refuses answers, and app.py checks
every field before it serves (`check_readable`).
"""

from __future__ import annotations

import typing
from contextlib import contextmanager

from app_ui.prepare_lane import PREPARING


class QueueUnreadable(RuntimeError):
    """Gradio's queue is not as this module reads it (a renamed field): its bounds cannot be
    checked, so answers are refused (and app.py does not start: `check_readable`)."""


@contextmanager
def _reading():
    try:
        yield
    except (AttributeError, KeyError, TypeError) as error:
        raise QueueUnreadable(f"Gradio's queue is not as app_ui/queue_rules.py reads it ({type(error).__name__}: "
                              f"{error})") from error


def check_readable(blocks) -> None:
    """QueueUnreadable naming what is missing, unless every field this module reads is there:
    the queue's lanes and jobs, a lane's list, and an event's session, group and request (app.py
    calls it before it serves)."""
    from gradio import queueing

    with _reading():
        queue = blocks._queue
        lanes, jobs = queue.event_queue_per_concurrency_id, queue.active_jobs
        if not isinstance(lanes, dict) or not isinstance(jobs, list):
            raise TypeError("event_queue_per_concurrency_id is not a dict or active_jobs not a list")
        lane = queueing.EventQueue("probe", 1)
        event = queueing.Event(None, next(iter(blocks.fns.values())), None, None)
        if not isinstance(lane.queue, list) or not isinstance(lane.current_concurrency, int):
            raise TypeError("EventQueue.queue is not a list or current_concurrency not a number")
        event.session_hash, event.concurrency_id, event.request, event._id  # noqa: B018 (each must be there)


def _waiting(blocks, group: str) -> list:
    lane = blocks._queue.event_queue_per_concurrency_id.get(group)  # a group's lane is made at its first event
    return lane.queue if lane is not None else []


def _held(blocks) -> list:
    """The answers whose images are being decoded before they join the line (app_ui/prepare_lane.py)."""
    return _waiting(blocks, PREPARING)


def _running(blocks, group: str) -> list:
    return [event for job in blocks._queue.active_jobs if job for event in job if event.concurrency_id == group]


def client_of(event) -> str:
    """The address the Guard stamped on the event's request."""
    return event.request.scope["state"]["client"]


def event_of(blocks, path: str, request: dict):
    """The event (Gradio's BlockFunction) a /queue/join, /call/<api> or /run/<api> body names, as
    Gradio finds it (the body's `fn_index`, else the path's api_name), or None."""
    with _reading():
        fns = blocks.fns
        if isinstance(request.get("fn_index"), int):
            return fns.get(request["fn_index"])
        if path.endswith("/queue/join"):
            return None
        api_name = path.rstrip("/").rsplit("/", 1)[-1]
        return next((fn for fn in fns.values() if fn.api_name == api_name), None)


def generates(blocks, group: str, path: str, request: dict) -> bool:
    """Whether the request (a /queue/join or /call/<api> body) asks for an event of `group`."""
    fn = event_of(blocks, path, request)
    return fn is not None and fn.concurrency_id == group


def takes_event_data(fn) -> bool:
    """Whether Gradio hands the event's handler its event data (a gr.EventData parameter): the
    request's `event_data` must then be what Gradio builds it from."""
    from gradio.helpers import EventData

    with _reading():
        hints = typing.get_type_hints(fn.fn) if callable(fn.fn) else {}
    return any(isinstance(hint, type) and issubclass(hint, EventData) for hint in hints.values())


def refusal(blocks, group: str, session_hash: str | None, client: str, per_client: int) -> str | None:
    """Why an answer of `session_hash` from `client` may not join the queue now, or None;
    QueueUnreadable when the queue cannot be read."""
    with _reading():
        waiting, running = _waiting(blocks, group) + _held(blocks), _running(blocks, group)
        mine = sum(client_of(event) == client for event in waiting + running)
        queued = bool(session_hash) and any(event.session_hash == session_hash for event in waiting)
    if queued:
        return ("this conversation already has an answer waiting in the queue: wait for it to start, or press "
                "Stop")
    if per_client and mine >= per_client:
        return (f"{mine} answers from your address are waiting or running, the limit is {per_client}: wait for one "
                "to end")
    return None


def interleave(blocks, group: str) -> None:
    """Put the waiting answers in turns by address (stable: each address's own stay in order);
    an address whose answer runs now comes after the addresses that have none running."""
    with _reading():
        waiting = _waiting(blocks, group)
        if len(waiting) < 2:
            return
        taken: dict[str, int] = {}
        for event in _running(blocks, group):
            taken[client_of(event)] = taken.get(client_of(event), 0) + 1
        ranks = []
        for event in waiting:
            client = client_of(event)
            ranks.append(taken.get(client, 0))
            taken[client] = ranks[-1] + 1
    order = sorted(range(len(waiting)), key=lambda i: ranks[i])
    waiting[:] = [waiting[i] for i in order]


def sessions(blocks, group: str) -> set[str]:
    """The session ids with an answer waiting or running."""
    with _reading():
        return {event.session_hash for event in _waiting(blocks, group) + _held(blocks) + _running(blocks, group)}
