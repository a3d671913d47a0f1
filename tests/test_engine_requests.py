"""Requests on a real tiny model: sampling, abandoned streams, and request errors."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.engine import Engine, RequestError
from engine.loop import Chunk, DecodeSettings, Done
from engine.sampling import SamplingSettings
from measure.exactness import conversation
from tests.helpers import Gate

DECODE = DecodeSettings(max_new_tokens=16, draft_tokens=3, stop_token_ids=frozenset({-1}))
WAIT_S = 120  # the longest a test waits for another thread's request


@pytest.fixture(scope="module")
def engine(zoo):
    return Engine(zoo.target("qwen2_vl"), {"text": zoo.drafter("qwen2_vl", "text_drafter"),
                                           "vlm": zoo.drafter("qwen2_vl", "same_vlm"),
                                           "ngram": zoo.drafter("qwen2_vl", "ngram")}, max_images=4)


def final(events):
    return [e for e in events if isinstance(e, Done)][0]


@pytest.mark.parametrize("drafter", ["text", "vlm", "ngram"])
def test_sampling_is_seeded_and_completes(engine, drafter):
    sampling = SamplingSettings(temperature=0.9, top_p=0.9, top_k=50, seed=7)
    first = final(engine.stream(conversation(2), drafter, sampling, DECODE))
    again = final(engine.stream(conversation(2), drafter, sampling, DECODE))
    assert first.token_ids == again.token_ids and len(first.token_ids) == 16
    assert first.stats.fallback_reason is None and first.stats.drafted > 0


def test_abandoned_and_stopped_streams_leave_the_engine_ready(engine):
    fresh = final(engine.stream(conversation(1), "text", decode=DECODE)).token_ids
    stream = engine.stream(conversation(1), "text", decode=DECODE)
    next(stream), next(stream)
    stream.close()  # the consumer walks away mid-answer
    stop = threading.Event()
    with Gate(engine.target.runner, at=2) as gate:  # the worker decodes ahead of this reader: hold it mid-answer
        stopped = engine.stream(conversation(2), "vlm", decode=DECODE, stop=stop)
        next(stopped)
        gate.wait()
        stop.set()
    events = list(stopped)
    assert events[-1].stats.finish_reason == "stopped" and len(events[-1].token_ids) < DECODE.max_new_tokens
    assert final(engine.stream(conversation(1), "text", decode=DECODE)).token_ids == fresh
    assert not engine.lock.locked()


def test_a_stream_left_unclosed_after_one_chunk_does_not_block_the_next_request(engine):
    """A caller that reads one chunk and walks away without closing its stream, while something
    still refers to it (a list, a traceback): another request, on another thread, completes."""
    left = engine.stream(conversation(1), "text", decode=DECODE)
    assert isinstance(next(left), Chunk)
    answered = []
    other = threading.Thread(target=lambda: answered.append(final(engine.stream(conversation(2), None, decode=DECODE))),
                             daemon=True)
    other.start()
    other.join(WAIT_S)  # bounded: before the worker held the engine, `left` kept its lock and this waited forever
    assert answered and answered[0].stats.finish_reason == "max_new_tokens"
    assert final(left).stats.finish_reason == "max_new_tokens"  # it was answered without its reader


def test_too_many_images_and_unknown_drafter_are_refused_clearly(engine):
    with pytest.raises(RequestError, match="5 images .* limit is 4"):
        list(engine.stream(conversation(5), "text", decode=DECODE))
    with pytest.raises(RequestError, match="unknown drafter 'eagle'"):
        list(engine.stream(conversation(1), "eagle", decode=DECODE))
    assert len(final(engine.stream(conversation(1), "text", decode=DECODE)).token_ids) == 16


def test_out_of_memory_in_the_target_ends_the_request_and_the_engine_recovers(engine, monkeypatch):
    fresh = final(engine.stream(conversation(1), "text", decode=DECODE)).token_ids
    runner = engine.target.runner
    calls = {"n": 0}
    real_extend = runner.extend

    def failing_extend(state, token_ids):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return real_extend(state, token_ids)

    monkeypatch.setattr(runner, "extend", failing_extend)
    with pytest.raises(RequestError, match="out of memory"):
        list(engine.stream(conversation(1), "text", decode=DECODE))
    monkeypatch.undo()
    assert not engine.lock.locked()
    assert final(engine.stream(conversation(1), "text", decode=DECODE)).token_ids == fresh


def test_answers_are_cut_to_fit_the_context(engine, monkeypatch):
    prompt_len = len(engine.prepare(conversation(1)).input_ids)
    monkeypatch.setattr(engine, "context_limit", lambda: prompt_len + 5)
    done = final(engine.stream(conversation(1), "text", decode=DecodeSettings(max_new_tokens=50, draft_tokens=4,
                                                                               stop_token_ids=frozenset({-1}))))
    assert len(done.token_ids) == 5 and done.stats.finish_reason == "context"  # cut by the context, and says so
