"""Stop for answers that wait in Gradio's queue: they leave it at once.

Gradio runs the events of the concurrency group "generate" one at a time; an answer stopped
while it waits would keep its place until the answer ahead of it ends. `leave_queue` moves a
session's waiting events to a lane of their own with no limit, so each runs now, sees its stop
flag set and ends without an answer (app_ui/session.py).

Gradio has no public way to do this, so one small adapter, `GradioQueue`, is the only code here
that touches its queue's internals (gradio/queueing.py, read for Gradio 6: `Blocks._queue`,
`Queue.event_queue_per_concurrency_id`, `Queue.delete_lock`, `EventQueue(concurrency_id,
concurrency_limit)`, its `queue` list and `current_concurrency`, `Event.session_hash`, `Event._id`
and `Event.concurrency_id`).
tests/test_stop_lane.py runs it on a real Gradio queue, so an upgrade that moves any of them fails
there, not silently in production.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

STOPPED_LANE = "stopped"


class GradioQueue:
    """Gradio's event queue, as Stop needs it: lanes (concurrency groups) of waiting events."""

    def __init__(self, queue):
        from gradio.queueing import EventQueue

        self.queue, self._lane_type = queue, EventQueue

    @classmethod
    def of(cls, request) -> GradioQueue | None:
        """The queue that serves `request` (a gr.Request); None when no Gradio queue does (a test
        calling the handler directly)."""
        queue = getattr(getattr(getattr(request, "request", None), "app", None), "get_blocks", lambda: None)()
        queue = getattr(queue, "_queue", None)
        return cls(queue) if queue is not None else None

    @property
    def lock(self):
        """Held while events are moved between lanes (Gradio's own lock for deleting events)."""
        return self.queue.delete_lock

    def limited_lanes(self) -> list:
        """The lanes with a concurrency limit (where a waiting event may wait long)."""
        return [lane for lane in self.queue.event_queue_per_concurrency_id.values()
                if lane.concurrency_limit is not None]

    def unlimited_lane(self, name: str):
        """The lane `name` with no concurrency limit, made when missing."""
        lanes = self.queue.event_queue_per_concurrency_id
        return lanes.setdefault(name, self._lane_type(name, None))

    def held_lane(self, name: str):
        """The lane `name` whose one slot is taken for ever, so Gradio starts none of its events
        (`EventQueue.current_concurrency` at its limit; no event of it ever ends to free it), made
        when missing (app_ui/prepare_lane.py)."""
        lanes = self.queue.event_queue_per_concurrency_id
        if name not in lanes:
            lane = self._lane_type(name, 1)
            lane.current_concurrency = 1
            lanes[name] = lane
        return lanes[name]

    def lane(self, name: str):
        return self.queue.event_queue_per_concurrency_id[name]

    @staticmethod
    def event(lane, event_id: str):
        """The event of `lane` with Gradio's id `event_id` (`Event._id`), or None."""
        return next((event for event in lane.queue if event._id == event_id), None)

    @staticmethod
    def waiting(lane, session_hash: str) -> list:
        return [event for event in lane.queue if event.session_hash == session_hash]

    @staticmethod
    def move(event, source, target) -> None:
        source.queue.remove(event)
        event.concurrency_id = target.concurrency_id
        target.queue.append(event)


async def leave_queue(request, session_hash: str | None) -> int:
    """Move the waiting events of `session_hash` out of every limited concurrency group into the
    unlimited STOPPED_LANE; returns how many moved. `request`: the gr.Request of the Stop."""
    queue = GradioQueue.of(request)
    if queue is None or not session_hash:
        return 0
    moved = 0
    async with queue.lock:
        stopped = queue.unlimited_lane(STOPPED_LANE)
        for lane in queue.limited_lanes():
            for event in queue.waiting(lane, session_hash):
                queue.move(event, lane, stopped)
                moved += 1
    return moved
