"""The engine worker (engine/worker.py) and the built-in backend: requests queue in order, a
caller that walks away holds nothing, a waiting request stopped leaves the queue at once, and
the events are Engine._run's (one request alone). Running answers are held at a gate in the target's `extend`
(the test releases it), never at "long enough"."""

from __future__ import annotations

import threading
import time
from dataclasses import fields

import pytest
import torch

from engine.backend import BuiltIn, Request
from engine.engine import Engine, RequestError
from engine.loop import Chunk, DecodeSettings, Done
from measure.exactness import conversation

DECODE = DecodeSettings(max_new_tokens=12, draft_tokens=3, stop_token_ids=frozenset({-1}))
TIMES = {"prefill_s", "prepare_s", "ttft_s", "drafter_prefill_s", "decode_s", "decode_tok_s", "total_s",
         "tok_s_curve", "draft_length_reason", "draft_length_changes", "draft_lengths"}
WAIT_S = 120  # a bound on every wait, so that a broken worker fails the test instead of hanging it


@pytest.fixture(scope="module")
def engine(zoo):
    return Engine(zoo.target("qwen2_vl"), {"text": zoo.drafter("qwen2_vl", "text_drafter")}, max_images=4)


class Gate:
    """Holds the worker in the target's `at_call`-th extend (a verify pass) until released."""

    def __init__(self, monkeypatch, runner, at_call: int = 2):
        self.reached, self.released, self.calls = threading.Event(), threading.Event(), 0
        extend = runner.extend

        def gated(*args, **kwargs):
            self.calls += 1
            if self.calls == at_call:
                self.reached.set()
                assert self.released.wait(WAIT_S)
            return extend(*args, **kwargs)

        monkeypatch.setattr(runner, "extend", gated)


@pytest.fixture
def finished(engine, monkeypatch):
    """The Done of every request the engine ends, in order, with the request's question, as the
    worker sees them (not the caller)."""
    done, steps = [], engine._steps

    def recording(messages, **options):
        answer = steps(messages, **options)
        item = next(answer)
        while True:  # events and passes out, each pass's logits back in
            if isinstance(item, Done):
                done.append((messages[-1]["content"][-1]["text"], item))
            try:
                item = answer.send((yield item))
            except StopIteration:
                return

    monkeypatch.setattr(engine, "_steps", recording)
    return done


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}]}]


def untimed(stats) -> dict:
    return {f.name: getattr(stats, f.name) for f in fields(stats) if f.name not in TIMES}


@pytest.mark.parametrize("drafter", [None, "text"])
def test_events_equal_engine_stream_and_carry_snapshots(engine, drafter):
    with engine.lock:  # in this thread, as the worker runs it
        direct = list(engine._run(conversation(1), drafter, decode=DECODE))
    served = list(BuiltIn(engine).stream(Request(conversation(1), drafter, decode=DECODE)))
    assert [type(e) for e in served] == [type(e) for e in direct]
    for a, b in zip(direct, served):
        assert (a.text, a.token_ids, getattr(a, "origins", None)) == (b.text, b.token_ids, getattr(b, "origins", None))
        assert untimed(a.stats) == untimed(b.stats)
    counts = [e.stats.new_tokens for e in served]
    assert counts == sorted(counts) and counts[0] == 1 < counts[-1] == 12  # each event its own snapshot
    assert len({id(e.stats) for e in served}) == len(served)


def test_two_requests_queue_in_order(engine, monkeypatch, finished):
    gate = Gate(monkeypatch, engine.target.runner)
    first = engine.worker.submit(ask("first"), decode=DECODE)
    assert gate.reached.wait(WAIT_S)
    second, third = (engine.worker.submit(ask(text), decode=DECODE) for text in ("second", "third"))
    assert engine.worker.queued() == 2
    gate.released.set()
    answers = [list(stream)[-1] for stream in (third, first, second)]  # read in any order
    assert [text for text, _ in finished] == ["first", "second", "third"]
    assert all(done.stats.finish_reason == "max_new_tokens" for done in answers)


def test_stop_of_a_waiting_request_leaves_the_queue_at_once(engine, monkeypatch, finished):
    gate = Gate(monkeypatch, engine.target.runner)
    running = engine.worker.submit(ask("running"), decode=DECODE)
    assert gate.reached.wait(WAIT_S)
    stop = threading.Event()
    waiting = engine.worker.submit(ask("waiting"), drafter="text", decode=DECODE, stop=stop)
    stop.set()
    events = list(waiting)  # the running request is still held at the gate
    assert len(events) == 1 and events[0].stats.finish_reason == "stopped" and events[0].stats.drafter
    assert engine.worker.queued() == 0 and not gate.released.is_set()
    gate.released.set()
    assert list(running)[-1].stats.finish_reason == "max_new_tokens"
    assert [text for text, _ in finished] == ["running"]  # the stopped one never reached the engine


@pytest.mark.parametrize("leave", ["close", "drop"])
def test_a_caller_that_walks_away_mid_answer_stops_its_request(engine, monkeypatch, finished, leave):
    gate = Gate(monkeypatch, engine.target.runner, at_call=3)
    stream = engine.worker.submit(ask("left"), decode=DECODE)
    assert isinstance(next(stream), Chunk)
    assert gate.reached.wait(WAIT_S)
    stream.close() if leave == "close" else None
    del stream
    gate.released.set()
    after = list(engine.worker.submit(ask("next"), decode=DECODE))
    assert after[-1].stats.finish_reason == "max_new_tokens"
    assert [(text, done.stats.finish_reason) for text, done in finished] == [("left", "stopped"),
                                                                             ("next", "max_new_tokens")]


def test_a_caller_that_stops_reading_holds_nothing(engine, finished):
    idle = engine.worker.submit(ask("unread"), decode=DECODE)
    assert isinstance(next(idle), Chunk)  # then not read again, not closed: the answer goes on
    after = list(engine.worker.submit(ask("next"), decode=DECODE))
    assert after[-1].stats.finish_reason == "max_new_tokens"
    rest = list(idle)  # decoded without its reader: the reader's time is not decode time
    assert rest[-1].stats.finish_reason == "max_new_tokens" and rest[-1].stats.new_tokens == 12
    assert [text for text, _ in finished] == ["unread", "next"]


def test_a_refused_request_raises_in_its_reader_and_the_worker_goes_on(engine):
    with pytest.raises(RequestError, match="unknown drafter 'eagle'"):
        list(engine.worker.submit(ask("hello"), drafter="eagle", decode=DECODE))
    assert list(engine.worker.submit(ask("hello"), decode=DECODE))[-1].stats.new_tokens == 12


def test_the_loop_times_from_the_request_start_and_says_what_the_engine_decided(engine):
    """Statistics are made by the loop alone, from what the engine passes (RequestInfo)."""
    started = time.perf_counter() - 5.0  # five seconds of image and prompt preparation before the loop
    events = list(engine.stream(conversation(1), "auto", decode=DECODE, started=started))
    for event in events:
        stats = event.stats
        assert stats.prepare_s >= 5.0 and stats.ttft_s == stats.prepare_s + stats.prefill_s
        assert stats.total_s >= stats.ttft_s and stats.auto_choice  # the auto choice on every event, not patched on
    limit = engine.context_limit()
    prompt = engine.prepare(conversation(1))
    room = limit - len(prompt.input_ids)
    done = list(engine.stream(prompt, decode=DecodeSettings(max_new_tokens=room + 50, stop_token_ids=frozenset({-1}))))
    assert done[-1].stats.finish_reason == "context" and len(done[-1].token_ids) == room


def test_the_callers_openmp_pool_is_given_back_before_the_worker_computes():
    """engine/openmp_pool.py: the main thread's idle pool would make every parallel region of the
    worker's wake a sleeping thread (3x slower decoding on 2 cores); torch's OpenMP runtime is
    found and gives it back."""
    from engine.openmp_pool import release_thread_pool

    torch.randn(1 << 20).add_(1)  # a parallel region on this thread: its pool exists
    assert release_thread_pool()


def test_preparing_a_prompt_does_not_wait_for_the_running_answer(engine, monkeypatch):
    gate = Gate(monkeypatch, engine.target.runner)
    stream = engine.stream(conversation(1), "text", decode=DECODE)
    events = iter(stream)
    next(events)
    assert gate.reached.wait(WAIT_S)  # the worker is mid-answer, holding the engine's lock
    prepared = []
    caller = threading.Thread(target=lambda: prepared.append(engine.prepare(conversation(2))))
    caller.start()
    caller.join(WAIT_S)
    held = caller.is_alive()
    gate.released.set()
    rest = list(events)
    caller.join(WAIT_S)
    assert not held and len(prepared[0].images) == 2  # before: it waited for the whole answer
    assert isinstance(rest[-1], Done)
