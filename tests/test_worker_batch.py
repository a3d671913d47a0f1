"""The worker's rounds (engine/worker.py): several answers stepped together, each round's target
passes in one shared pass (engine/runner.py `Runner.run`). Each answer is token for token what
it is alone (greedy and sampled with a seed; text and picture turns; plain, chains and trees); a
stopped answer leaves while the others go on; beyond `running_requests` a request waits with its
place in line; every cache is let go at the end. The requests are held together by the test
holding the engine's lock while it submits them (the worker waits for it before each round), or
at a gate in the target's `run`, never at "long enough"."""

from __future__ import annotations

import gc
import threading
from dataclasses import replace

import pytest

from engine.engine import Engine
from engine.loop import DecodeSettings, Done
from engine.sampling import SamplingSettings
from engine.static_cache import StaticKVCache
from measure.exactness import conversation
from tests.helpers import wait_until

DECODE = DecodeSettings(max_new_tokens=12, draft_tokens=3, stop_token_ids=frozenset({-1}))
TREE = replace(DECODE, draft_tree=6)
WAIT_S = 120
# (images, drafter, decode): plain, chains and a tree; text and picture turns
MIX = [(0, None, DECODE), (1, "text", DECODE), (2, None, DECODE), (1, "text", TREE), (0, "text", DECODE)]


@pytest.fixture(scope="module")
def engine(zoo):
    return Engine(zoo.target("qwen2_vl"), {"text": zoo.drafter("qwen2_vl", "text_drafter")}, max_images=4,
                  running_requests=len(MIX))


@pytest.fixture
def passes(engine, monkeypatch):
    """The number of requests in each shared `run` of the target (a lone request's pass is its extend)."""
    sizes, run = [], engine.target.runner.run

    def recorded(passes):
        sizes.append(len(passes))
        return run(passes)

    monkeypatch.setattr(engine.target.runner, "run", recorded)
    return sizes


def alone(engine, images, drafter, decode, sampling=SamplingSettings()) -> Done:
    with engine.lock:  # in this thread, as the worker runs it, with nothing beside it
        return list(engine._run(conversation(images), drafter, sampling, decode))[-1]


def together(engine, requests, sampling=SamplingSettings()) -> list[Done]:
    """The requests submitted while the worker cannot start a round: they start in the same one."""
    with engine.lock:
        streams = [engine.stream(conversation(images), drafter, sampling, decode) for images, drafter, decode in requests]
    return [list(stream)[-1] for stream in streams]


@pytest.mark.parametrize("sampling", [SamplingSettings(), SamplingSettings(temperature=0.8, top_p=0.9, seed=7)],
                         ids=["greedy", "sampled"])
def test_answers_decoded_together_are_each_answer_alone(engine, passes, sampling):
    expected = [alone(engine, *request, sampling) for request in MIX]
    answers = together(engine, MIX, sampling)
    assert [done.token_ids for done in answers] == [done.token_ids for done in expected]
    assert all(len(done.token_ids) == 12 and done.stats.finish_reason == "max_new_tokens" for done in answers)
    assert passes and max(passes) == len(MIX)  # the first rounds held every request in one pass
    assert [done.stats.drafted for done in answers] == [done.stats.drafted for done in expected]


def test_a_stopped_answer_leaves_and_the_others_go_on(engine, monkeypatch):
    """Held at the second shared pass, one request's stop is set: it ends at the next round, stopped,
    the others finish as they would alone, and every cache is let go."""
    expected = [alone(engine, *request) for request in MIX]
    reached, released, run = threading.Event(), threading.Event(), engine.target.runner.run
    calls = []

    def gated(passes):
        calls.append(len(passes))
        if len(calls) == 2:
            reached.set()
            assert released.wait(WAIT_S)
        return run(passes)

    monkeypatch.setattr(engine.target.runner, "run", gated)
    caches = live_caches()
    stops = [threading.Event() for _ in MIX]
    with engine.lock:
        streams = [engine.stream(conversation(images), drafter, decode=decode, stop=stop)
                   for (images, drafter, decode), stop in zip(MIX, stops)]
    assert reached.wait(WAIT_S)
    stops[1].set()
    released.set()
    answers = [list(stream)[-1] for stream in streams]
    assert answers[1].stats.finish_reason == "stopped" and len(answers[1].token_ids) < 12
    others = [i for i in range(len(MIX)) if i != 1]
    assert [answers[i].token_ids for i in others] == [expected[i].token_ids for i in others]
    wait_until(lambda: not engine.worker.serving, "the worker's thread to end")
    del streams
    assert live_caches() == caches  # the stopped answer's and the finished ones' caches are gone


def test_beyond_running_requests_a_request_waits_with_its_place_in_line(engine, monkeypatch):
    """Held at the first shared pass: two requests run, two wait in line, in order."""
    monkeypatch.setattr(engine, "running_requests", 2)
    reached, released, run = threading.Event(), threading.Event(), engine.target.runner.run

    def gated(passes):
        reached.set()
        assert released.wait(WAIT_S)
        return run(passes)

    monkeypatch.setattr(engine.target.runner, "run", gated)
    with engine.lock:
        streams = [engine.stream(conversation(0), None, decode=DECODE) for _ in range(4)]
        assert [engine.worker.place(stream.job) for stream in streams] == [1, 2, 3, 4]
    assert reached.wait(WAIT_S)
    held = engine.worker.running, engine.worker.queued(), [engine.worker.place(stream.job) for stream in streams]
    released.set()
    answers = [list(stream)[-1] for stream in streams]
    assert held == (2, 2, [0, 0, 1, 2])
    assert len({tuple(done.token_ids) for done in answers}) == 1  # the same question, the same answer


def live_caches() -> int:
    gc.collect()
    return sum(type(obj) is StaticKVCache for obj in gc.get_objects())


def test_running_requests_comes_from_its_flag_or_variable():
    """--running-requests, else VLM_RUNNING_REQUESTS (the app reads variables), else 4, reaches the
    engine's spec; out of its range it is refused naming the variable."""
    import argparse

    from engine.build import spec_from_args
    from engine.load_settings import add_model_flags
    from models.loading import LoadError

    def running(environ: dict, *flags: str) -> int:
        parser = argparse.ArgumentParser()
        add_model_flags(parser, environ)
        return spec_from_args(parser.parse_args(["--preset", "demo", *flags])).running_requests

    assert running({}) == 4
    assert running({"VLM_RUNNING_REQUESTS": "8"}) == 8
    assert running({"VLM_RUNNING_REQUESTS": "8"}, "--running-requests", "2") == 2
    with pytest.raises(LoadError, match="VLM_RUNNING_REQUESTS: 0 is under 1"):
        running({"VLM_RUNNING_REQUESTS": "0"})


def test_rounds_beside_other_answers_are_not_priced_as_the_engines_pass_costs(zoo):
    """A round's times beside other answers hold their work too (engine/draft_length.py): the engine's
    measured pass costs learn from rounds alone only."""
    engine = Engine(zoo.target("qwen2_vl"), running_requests=3)
    together(engine, [(0, None, DECODE)] * 3)
    assert engine.costs.rounds == 0
    alone(engine, 0, None, DECODE)
    assert engine.costs.rounds == DECODE.max_new_tokens - 1  # the first token is the prefill's
