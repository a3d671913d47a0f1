"""Stop for answers that wait in Gradio's queue: they leave it at once.

Gradio runs the events of the concurrency group "generate" one at a time; an answer stopped
while it waits would keep its place until the answer ahead of it ends. `leave_queue` moves a
session's waiting events to a lane of their own with no limit, so each runs now, sees its stop
flag set and ends without an answer (app_ui/session.py). It uses Gradio's queue internals
(gradio/queueing.py: `event_queue_per_concurrency_id`, `EventQueue`, `delete_lock`), read
for Gradio 6.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

STOPPED_LANE = "stopped"


async def leave_queue(request, session_hash: str | None) -> int:
    """Move the waiting events of `session_hash` out of every limited concurrency group into the
    unlimited STOPPED_LANE; returns how many moved. `request`: the gr.Request of the Stop."""
    try:
        queue = request.request.app.get_blocks()._queue
        from gradio.queueing import EventQueue
    except (AttributeError, ImportError):  # not served by Gradio's queue (a test calling the handler)
        return 0
    if not session_hash:
        return 0
    moved = 0
    async with queue.delete_lock:
        lanes = queue.event_queue_per_concurrency_id
        lane = lanes.setdefault(STOPPED_LANE, EventQueue(STOPPED_LANE, None))
        for group in list(lanes.values()):
            if group is lane or group.concurrency_limit is None:
                continue
            for event in [e for e in group.queue if e.session_hash == session_hash]:
                group.queue.remove(event)
                event.concurrency_id = STOPPED_LANE
                lane.queue.append(event)
                moved += 1
    return moved
