"""Answers whose images are being decoded wait outside the answer lane (issue 57).

An answer that names its files in its request (/chat, /ab, the page's A/B) would decode them in the
answer slot, and the slot is one: a slow or hostile image would hold every other visitor's answer
for as long as its decode may take. So the Guard (app_ui/guard.py) holds such an answer, as it joins
Gradio's queue, in the lane PREPARING, whose one slot is taken for ever (stop_lane.GradioQueue
`held_lane`): Gradio starts none of its events. Meanwhile its files are decoded in the jail
(uploads.decode_uploads, on a worker thread; each kept on its upload's entry in the ledger,
app_ui/visitors.py), bounded by the jail's slots, the address's own decodes and the time budget;
then the answer moves to the answer lane and waits its turn there like any other (interleaved by
address, app_ui/queue_rules.py), and its handler finds the pixels kept. The page's own send needs
none of this: its prepare step runs outside the slot (app_ui/layout.py).

While held, the answer counts as waiting (queue_rules: one a conversation, a few an address). A
Stop moves it to the stopped lane (stop_lane.leave_queue: PREPARING is a limited lane), and a
client that leaves takes it out of the queue: either ends its decode (`held` is then false).
"""

from __future__ import annotations

from app_ui.stop_lane import GradioQueue

PREPARING = "preparing"


def hold(queue: GradioQueue, group: str, event_id: str | None):
    """Move the event `event_id` from the lane `group` to PREPARING; the event, or None when it is
    not waiting there. The caller holds `queue.lock` since before the event joined: Gradio cannot
    have started it."""
    source = queue.lane(group)
    event = queue.event(source, event_id) if event_id else None
    if event is not None:
        queue.move(event, source, queue.held_lane(PREPARING))
    return event


def held(queue: GradioQueue, event) -> bool:
    """Whether `event` still waits in PREPARING (no Stop, no cancel, no client gone); read from the
    decoding thread too (a list's membership: one step under the GIL)."""
    return event in queue.held_lane(PREPARING).queue


async def release(queue: GradioQueue, event, group: str) -> bool:
    """Move `event` from PREPARING to the end of the lane `group`, if it is still held; whether it was."""
    async with queue.lock:
        if not held(queue, event):
            return False
        queue.move(event, queue.held_lane(PREPARING), queue.lane(group))
        return True
