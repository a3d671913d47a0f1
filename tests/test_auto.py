"""`--drafter auto` (engine/auto.py): the choice among mock drafters with known speeds, and the
engine's wiring on a tiny model (the choice and its reason in the statistics)."""

from __future__ import annotations

import random

import pytest

from engine.auto import EXPLORE_EVERY, MIN_TOKENS, DrafterChooser
from engine.engine import Engine
from engine.loop import DecodeSettings, Done
from measure.exactness import conversation

# decode tok/s each mock drafter delivers, by the request's image count: the text drafter
# (blind to images) wins on text, the VLM drafter on image requests, n-gram never.
SPEED = {"text": {0: 300, 1: 150, 2: 140}, "vlm": {0: 250, 1: 280, 2: 260}, "ngram": {0: 200, 1: 130, 2: 120}}


def simulate(requests: int, seed: int = 0) -> tuple[DrafterChooser, list[tuple[int, str, str]]]:
    rng = random.Random(seed)
    chooser, log = DrafterChooser(list(SPEED)), []
    for _ in range(requests):
        images = rng.choice([0, 1, 2])
        name, reason = chooser.choose(images)
        chooser.record(name, images, 100, SPEED[name][images] * rng.uniform(0.9, 1.1))
        log.append((images, name, reason))
    return chooser, log


def test_each_drafter_is_tried_once_then_the_fastest_for_the_image_count_wins():
    _, log = simulate(120)
    first_tries = [(images, name) for images, name, reason in log if "no measured request" in reason]
    assert sorted(first_tries) == sorted((images, name) for images in (0, 1, 2) for name in SPEED)  # once each
    exploiting = [(images, name) for images, name, reason in log if "exploring" not in reason]
    best = {images: max(SPEED, key=lambda n: SPEED[n][images]) for images in (0, 1, 2)}
    assert all(name == best[images] for images, name in exploiting)
    assert len(exploiting) >= 100


def test_exploration_comes_back_every_tenth_request_to_the_stalest_drafter():
    _, log = simulate(60)
    explored = [i + 1 for i, (_, _, reason) in enumerate(log) if f"every {EXPLORE_EVERY}th" in reason]
    assert explored == [20, 30, 40, 50, 60]  # request 10 still tried a drafter new to its context
    assert sum(name == "ngram" for _, name, _ in log) >= 3  # the loser is still measured now and then


def test_the_reason_names_the_figures_compared():
    chooser = DrafterChooser(["text", "vlm"])
    chooser.record("text", 1, 50, 100.0)
    chooser.record("vlm", 1, 50, 200.0)
    chooser.record("vlm", 1, MIN_TOKENS - 1, 1.0)  # too short an answer to count
    name, reason = chooser.choose(1)
    assert name == "vlm"
    assert reason == ("auto: vlm (recent decode speed with 1 image, measured over this server's latest speculative "
                      "answers, any visitor's: vlm 200.0 tok/s, text 100.0 tok/s)")  # no counts
    name, reason = chooser.choose(3)  # no record with 3 or more images: tried first
    assert name == "text" and reason == "auto: text (exploring: no measured request with 3 or more images on this server yet)"


def test_the_engine_picks_per_request_and_says_why(zoo):
    engine = Engine(zoo.target("qwen2_vl"), {"text": zoo.drafter("qwen2_vl", "text_drafter"),
                                             "ngram": zoo.drafter("qwen2_vl", "ngram")}, auto=True)
    assert engine.default_drafter == "auto"
    decode = DecodeSettings(max_new_tokens=MIN_TOKENS + 4, stop_token_ids=frozenset({-1}))
    picked = []
    for _ in range(3):
        done = [e for e in engine.stream(conversation(1), "auto", decode=decode) if isinstance(e, Done)][0]
        assert done.stats.mode == "speculative" and done.stats.auto_choice.startswith("auto: ")
        picked.append(done.stats.drafter)
    assert picked[:2] == [engine.drafters["text"].name, engine.drafters["ngram"].name]  # each tried once
    assert "recent decode speed" in done.stats.auto_choice
    assert all(engine.chooser.records[key][1] for key in ("text", "ngram"))
    with pytest.raises(Exception, match="unknown drafter"):
        list(Engine(zoo.target("qwen2_vl")).stream(conversation(0), "auto"))
