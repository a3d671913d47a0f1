"""Who may queue answers, and in what order they run, read from Gradio's queue.

Events of the concurrency group that generates (callbacks.GENERATE: one answer at a time) wait in
one list. Unchecked, one visitor could fill it (200 answers from one session) and every other
visitor would wait behind them all. So, before Gradio queues an answer (`refusal`, called by
the Guard): a conversation may have one answer waiting, an address `Limits.answers_per_client`
waiting or running. And after each answer joins (`interleave`), the waiting list is put in turns
by address: every address's first waiting answer before any address's second, so a visitor
waits for at most one answer of each other address, not for all of one address's answers.

It uses Gradio's queue internals (gradio/queueing.py: `Queue.event_queue_per_concurrency_id`,
`EventQueue.queue`, `Queue.active_jobs`, `Event.session_hash`, `Event.request`), read for
Gradio 6, as app_ui/stop_lane.py does; an event's address is the one the Guard stamped on its
request (`scope["state"]["client"]`).
"""

from __future__ import annotations


def _queue(blocks):
    return getattr(blocks, "_queue", None)


def _waiting(blocks, group: str) -> list:
    lane = getattr(_queue(blocks), "event_queue_per_concurrency_id", {}).get(group)
    return lane.queue if lane is not None else []


def _running(blocks, group: str) -> list:
    jobs = getattr(_queue(blocks), "active_jobs", None) or []
    return [event for job in jobs if job for event in job if event.concurrency_id == group]


def client_of(event) -> str | None:
    request = getattr(event, "request", None)
    return (getattr(request, "scope", None) or {}).get("state", {}).get("client")


def generates(blocks, group: str, path: str, request: dict) -> bool:
    """Whether the request (a /queue/join or /call/<api> body) asks for an event of `group`."""
    fns = getattr(blocks, "fns", {})
    if path.endswith("/queue/join"):
        fn = fns.get(request.get("fn_index")) if isinstance(request.get("fn_index"), int) else None
    else:
        api_name = path.rsplit("/call/", 1)[-1] if "/call/" in path else None
        fn = next((fn for fn in fns.values() if api_name and fn.api_name == api_name), None)
    return fn is not None and fn.concurrency_id == group


def refusal(blocks, group: str, session_hash: str | None, client: str, per_client: int) -> str | None:
    """Why an answer of `session_hash` from `client` may not join the queue now, or None."""
    waiting, running = _waiting(blocks, group), _running(blocks, group)
    if session_hash and any(event.session_hash == session_hash for event in waiting):
        return ("this conversation already has an answer waiting in the queue: wait for it to start, or press "
                "Stop")
    mine = sum(client_of(event) == client for event in waiting + running)
    if per_client and mine >= per_client:
        return (f"{mine} answers from your address are waiting or running, the limit is {per_client}: wait for one "
                "to end")
    return None


def interleave(blocks, group: str) -> None:
    """Put the waiting answers in turns by address (stable: each address's own stay in order);
    an address whose answer runs now comes after the addresses that have none running."""
    waiting = _waiting(blocks, group)
    if len(waiting) < 2:
        return
    taken: dict[str | None, int] = {}
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
    return {event.session_hash for event in _waiting(blocks, group) + _running(blocks, group)}
