"""The llama.cpp backend against a real llama-server (in a child process) on the
bundled demo model converted to GGUF in float32 (models/gguf.py; converted once, cached in .gguf/).
Greedy answers are compared token by token with the built-in engine's on the same prompts."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest
import xllamacpp  # noqa: E402,F401  (in requirements.txt: a missing install fails here, never skips)

from engine.backend import Request as backend_request  # noqa: E402
from engine.backends.llamacpp import DRAFTER, FALLBACK, LlamaCpp  # noqa: E402
from engine.backends.llamacpp_native import binary  # noqa: E402
from engine.backends.messages import openai_content  # noqa: E402
from engine.engine import RequestError  # noqa: E402
from engine.loop import Chunk, DecodeSettings, Done  # noqa: E402
from models.demo.world import eval_questions  # noqa: E402
from tests.helpers import DEMO_TARGET as TARGET, DEMO_TEXT_DRAFTER as TEXT_DRAFTER, GarbageServer  # noqa: E402

DECODE = DecodeSettings(max_new_tokens=40)


def Request(messages, **fields) -> backend_request:  # noqa: N802 (engine/backend.py's Request at DECODE)
    return backend_request(messages, **{"decode": DECODE} | fields)


@pytest.fixture(scope="module")
def backend(llamacpp):
    return llamacpp


@pytest.fixture(scope="module")
def engine():
    from engine.build import EngineSpec, build_engine

    return build_engine(EngineSpec(TARGET))


def user(question=None, text="Describe a red circle in the top left corner."):
    images = question.images if question else []
    prompt = question.prompt if question else text
    return [{"role": "user", "content": [{"type": "image", "image": i} for i in images]
             + [{"type": "text", "text": prompt}]}]


def answer(stream) -> tuple[list[Chunk], Done]:
    events = list(stream)
    assert isinstance(events[-1], Done) and all(isinstance(e, Chunk) for e in events[:-1])
    return events[:-1], events[-1]


def ours(engine, messages) -> list[int]:
    """The built-in engine's greedy ids, without the final stop token (llama.cpp does not send it)."""
    done = [e for e in engine.stream(messages, decode=DECODE) if isinstance(e, Done)][0]
    return done.token_ids[:-1] if done.token_ids[-1] in engine.stop_token_ids() else done.token_ids


def test_text_turn_matches_the_built_in_engine(backend, engine):
    chunks, done = answer(backend.stream(Request(user())))
    assert done.text and done.text == "".join(c.text for c in chunks)
    assert done.token_ids == [i for c in chunks for i in c.token_ids] == ours(engine, user())
    assert done.stats.mode == "plain" and done.stats.finish_reason in ("stop_token", "max_new_tokens")
    end = done.stats.finish_reason == "stop_token"  # counted as the built-in engine counts it, never sent
    assert done.stats.new_tokens == len(done.token_ids) + end and done.stats.prefill_tokens > 0


def test_an_answer_has_as_many_tokens_as_the_built_in_engines(backend, engine):
    """Both count the end-of-answer token (llama-server never sends it): two identical answers
    once read "2 tokens" and "1 token" side by side in the A/B."""
    questions = [user(), *(user(q) for q in eval_questions(0, 8) if q.images)][:3]
    ends = 0
    for messages in questions:
        built_in = [e for e in engine.stream(messages, decode=DECODE) if isinstance(e, Done)][0]
        _, done = answer(backend.stream(Request(messages, decode=DECODE)))
        assert done.stats.finish_reason == built_in.stats.finish_reason
        assert done.stats.new_tokens == built_in.stats.new_tokens
        assert done.stats.decode_tokens == built_in.stats.decode_tokens
        ends += done.stats.finish_reason == "stop_token"
    assert ends  # at least one answer ended by itself (the case that differed)


def test_image_turns_match_the_built_in_engine(backend, engine):
    """One and several images: the several-image prompt needs the "Picture N: " labels."""
    questions = [q for q in eval_questions(0, 8) if q.images]
    assert {len(q.images) for q in questions} >= {1, 2}
    for question in questions[:3]:
        _, done = answer(backend.stream(Request(user(question))))
        assert done.token_ids == ours(engine, user(question)), question.prompt


def test_text_turn_with_the_draft_model_reports_drafts(backend):
    _, plain = answer(backend.stream(Request(user())))
    _, done = answer(backend.stream(Request(user(), drafter=DRAFTER)))
    assert done.text == plain.text and done.stats.new_tokens == plain.stats.new_tokens
    assert done.token_ids == []  # llama-server sends no ids for drafted tokens: unknown, not guessed
    assert done.stats.mode == "speculative" and done.stats.fallback_reason is None
    assert 0 < done.stats.drafted and 0 <= done.stats.accepted <= done.stats.drafted
    assert done.stats.acceptance == done.stats.accepted / done.stats.drafted


def test_image_turn_with_the_draft_model_falls_back_to_plain(backend):
    question = next(q for q in eval_questions(0, 8) if q.images)
    _, plain = answer(backend.stream(Request(user(question))))
    _, done = answer(backend.stream(Request(user(question), drafter=DRAFTER)))
    assert done.stats.fallback_reason == FALLBACK and done.stats.mode == "plain"
    assert done.token_ids == plain.token_ids and done.stats.drafted == 0


def test_stop_mid_stream(backend):
    stop = threading.Event()
    stream = backend.stream(Request(user(), stop=stop, decode=DecodeSettings(max_new_tokens=64)))
    first = next(e for e in stream if isinstance(e, Chunk) and e.token_ids)
    stop.set()  # the gate: the answer has started, and is told to stop
    rest = list(stream)
    assert isinstance(rest[-1], Done) and rest[-1].stats.finish_reason == "stopped"
    assert rest[-1].token_ids == first.token_ids  # nothing after the chunk in hand
    _, again = answer(backend.stream(Request(user())))  # the server is free for the next request
    assert again.stats.finish_reason in ("stop_token", "max_new_tokens")


@pytest.mark.parametrize("chunks, message", [
    ([{"error": {"code": 500, "message": "boom\nat line 2"}}], "llama.cpp failed: boom at line 2"),
    ([{"choices": [{"delta": {"content": "half"}}]}], "llama.cpp ended the answer without a finish reason"),
    ([], "llama.cpp answered nothing"),
])
def test_a_broken_server_gives_a_one_line_error(backend, chunks, message):
    plain_server = backend.plain_server
    backend.plain_server = GarbageServer(chunks)
    try:
        with pytest.raises(RequestError) as error:
            list(backend.stream(Request(user())))
    finally:
        backend.plain_server = plain_server
    assert str(error.value) == message and "\n" not in str(error.value)


def test_a_drafter_it_does_not_have_is_refused(backend):
    with pytest.raises(RequestError, match="one draft model"):
        list(backend.stream(Request(user(), drafter="ngram")))


def test_a_text_model_runs_without_a_projector_and_refuses_images():
    text_only = LlamaCpp.from_checkpoint(TEXT_DRAFTER, threads=1)
    assert text_only.paths["mmproj"] is None and text_only.url.startswith("http://127.0.0.1:")
    _, done = answer(text_only.stream(Request([{"role": "user", "content": "Describe a red circle."}])))
    assert done.text and done.token_ids
    question = next(q for q in eval_questions(0, 8) if q.images)
    with pytest.raises(RequestError, match="no vision projector"):
        list(text_only.stream(Request(user(question))))


def test_openai_content_merges_text_and_labels_images():
    image = object.__new__(type("Image", (), {"save": lambda self, buffer, format: buffer.write(b"x")}))
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}, {"type": "image", "image": image},
             {"type": "image", "image": image}, {"type": "text", "text": "c"}]
    content = openai_content(parts, True, iter(range(1, 9)))
    assert [p.get("text", "IMG") for p in content] == ["abPicture 1: ", "IMG", "Picture 2: ", "IMG", "c"]
    assert openai_content(parts[:2], True, iter(range(1, 9))) == "ab"


def test_capabilities_follow_the_backend_interface(backend):
    capabilities = backend.capabilities
    assert capabilities.images and capabilities.speculative and capabilities.drafters == (DRAFTER,)
    assert capabilities.default_drafter == DRAFTER and not capabilities.draft_origins  # drafts by default; origins unknown
    assert capabilities.drafter_kinds == ("text_lm",)  # the app's label: "Text-only LM"
    assert "drafted" in capabilities.statistics and "tokens_per_forward" in capabilities.unknown()


def test_eval_row_compares_token_ids_with_the_built_in_engine(capsys):
    from measure.eval import main

    assert main(["--preset", "demo", "--limit", "4", "--drafter", "none", "--max-new-tokens", "24",
                 "--backend", "llamacpp", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [r["mode"] for r in rows] == ["plain", "llama.cpp"]
    assert rows[1]["identical_to_plain"] == 1.0 and rows[1]["differing"] == []  # float32: the same ids


def test_bench_rows_for_llama_cpp(tmp_path, capsys):
    """Plain on the requests (ids compared with this engine's), and with the text drafter as
    llama.cpp's draft model on the requests' text; the bound printed beside the plain rows."""
    from measure.bench import main

    out = tmp_path / "bench.json"
    assert main(["--preset", "demo", "--drafter", TEXT_DRAFTER, "--requests", "2", "--max-new-tokens", "16",
                 "--no-transformers", "--llamacpp", "--json", str(out), "--plot", ""]) == 0
    rows = {(r["engine"], r["mode"], r["drafter"]): r for r in json.loads(out.read_text())["rows"]}
    build = "native" if binary("llama-server") else "prebuilt"  # the native build where it has been built
    assert rows[("llama.cpp", "plain", build)]["identical_to_plain"] == 2
    speculative = rows[("llama.cpp", "speculative", f"text_drafter, text turns, {build}")]
    assert speculative["identical_to_plain"] == 2 and speculative["acceptance"] is not None
    printed = capsys.readouterr().out
    assert printed.count("bound: ") == 3 and f"| llama.cpp plain ({build}) |" in printed


def test_tokens_the_stream_held_back_are_counted_from_the_servers_timings(backend):
    """llama-server holds back a piece that is not yet whole UTF-8 (random weights write such
    tokens), so a 24-token answer can stream as one chunk: its count and decode speed come from
    the server's `timings` (predicted_n, predicted_ms), not from the chunks seen."""
    piece = {"choices": [{"delta": {"content": "a"}, "logprobs": {"content": [{"id": 7}]}}]}
    last = {"choices": [{"delta": {}, "finish_reason": "length"}],
            "timings": {"prompt_n": 5, "prompt_ms": 2.0, "predicted_n": 24, "predicted_ms": 46.0}}
    plain_server = backend.plain_server
    backend.plain_server = GarbageServer([piece, last])
    try:
        *_, done = backend.stream(Request(user()))
    finally:
        backend.plain_server = plain_server
    assert done.stats.new_tokens == 24 and done.stats.decode_tok_s == pytest.approx(23 / 0.046)


def test_llama_cpp_runs_in_a_child_process(backend):
    child = backend.plain()._child
    assert child.pid != os.getpid() and child.poll() is None
    assert backend.url.startswith("http://127.0.0.1:")  # this process only speaks HTTP to it


def test_a_child_that_dies_mid_answer_is_a_named_error_then_a_restart(backend):
    long = DecodeSettings(max_new_tokens=3000, stop_token_ids=(-1,))  # ignore_eos: thousands of tokens to go
    stream = backend.stream(Request(user(), decode=long))
    next(stream)  # the answer is streaming (plainly: no drafter asked for)
    os.kill(backend.plain()._child.pid, signal.SIGKILL)
    with pytest.raises(RequestError, match=r"llama.cpp failed: .*(exited with code -9 mid-answer|connection .* broke)"):
        list(stream)
    _, done = answer(backend.stream(Request(user())))  # started again: the next request is answered
    assert done.stats.finish_reason in ("stop_token", "max_new_tokens") and done.text


def test_a_child_found_dead_is_started_again_and_answers(backend):
    child = backend.plain()._child
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    _, done = answer(backend.stream(Request(user())))
    assert done.text and backend.plain()._child.poll() is None
