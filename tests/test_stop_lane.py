"""app_ui/stop_lane.py on a real Gradio queue: the adapter's view of Gradio's internals (its
queue, lanes, lock and events) holds for the installed Gradio, so an upgrade that changes them
fails here. No server: the queue Gradio builds for a Blocks, and events made as Gradio makes them."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import gradio as gr
from gradio.queueing import Event

from app_ui.stop_lane import STOPPED_LANE, GradioQueue, leave_queue


def run_apart(coroutine):
    """`asyncio.run` on a thread of its own: an earlier test (the browser's) may leave an event
    loop running on this one."""
    result = {}
    thread = threading.Thread(target=lambda: result.update(value=asyncio.run(coroutine)))
    thread.start()
    thread.join()
    return result["value"]


def queued_blocks():
    """A Blocks with one limited group ("generate") and its lane, as the app's queue has it."""
    with gr.Blocks() as demo:
        button, box = gr.Button(), gr.Textbox()
        button.click(lambda: "x", None, box, concurrency_limit=1, concurrency_id="generate")
    demo.queue(default_concurrency_limit=1)
    fn = next(iter(demo.fns.values()))
    demo._queue.create_event_queue_for_fn(fn)
    return demo, fn


def request_of(demo):
    """A gr.Request's shape as the Stop handler gets it: request.request.app.get_blocks()."""
    return SimpleNamespace(request=SimpleNamespace(app=SimpleNamespace(get_blocks=lambda: demo)))


def test_stop_moves_only_that_sessions_waiting_events_to_an_unlimited_lane():
    demo, fn = queued_blocks()
    lane = demo._queue.event_queue_per_concurrency_id["generate"]
    mine, other = Event("mine", fn, None, None), Event("other", fn, None, None)
    lane.queue.extend([mine, other])
    assert run_apart(leave_queue(request_of(demo), "mine")) == 1
    stopped = demo._queue.event_queue_per_concurrency_id[STOPPED_LANE]
    assert stopped.concurrency_limit is None and stopped.queue == [mine] and mine.concurrency_id == STOPPED_LANE
    assert lane.queue == [other] and other.concurrency_id == "generate"
    assert run_apart(leave_queue(request_of(demo), "mine")) == 0  # nothing left waiting


def test_the_adapter_reads_gradios_queue_and_says_none_without_one():
    demo, _ = queued_blocks()
    queue = GradioQueue.of(request_of(demo))
    assert queue is not None and queue.queue is demo._queue
    assert [lane.concurrency_id for lane in queue.limited_lanes()] == ["generate"]
    assert hasattr(queue.lock, "acquire")
    assert GradioQueue.of(SimpleNamespace(request=None)) is None  # a handler called directly, not served
    assert run_apart(leave_queue(SimpleNamespace(request=None), "mine")) == 0
