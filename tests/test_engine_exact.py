"""Speculative greedy == plain greedy, token for token, in float32, for every family x drafter
kind, with 0, 1, 2 and 4 images and a two-turn chat; plain greedy == transformers' generate();
a drafter with the target's own weights is always accepted (the proof that positions are right)."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.loop import DecodeSettings, Done
from tests import tiny

DRAFTERS = ("text_drafter", "vlm_drafter", "ngram")
MAX_NEW = 24


def user(text, images=()):
    return {"role": "user", "content": [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]}


def conversation(num_images: int, two_turns: bool = False):
    images = tiny.tiny_images(max(num_images, 1) + 1, seed=num_images)
    if not two_turns:
        return [user("Describe what you see, then say more.", images[:num_images])]
    return [user("What is in these pictures?", images[:2]),
            {"role": "assistant", "content": [{"type": "text", "text": "A red square and a blue circle."}]},
            user("And which one is larger?")]


def run(zoo, family, drafter_role, messages, k=4, adaptive=False):
    target = zoo.target(family)
    drafters = {drafter_role: zoo.drafter(family, drafter_role)} if drafter_role else {}
    engine = Engine(target, drafters)
    events = list(engine.stream(messages, drafter=drafter_role,
                                decode=DecodeSettings(max_new_tokens=MAX_NEW, draft_tokens=k, adaptive=adaptive,
                                                      stop_token_ids=frozenset({-1}))))
    done = events[-1]
    assert isinstance(done, Done)
    assert sum(len(e.token_ids) for e in events[:-1]) == len(done.token_ids)
    return done


CASES = [(n, False) for n in (0, 1, 2, 4)] + [(2, True)]


@pytest.mark.parametrize("family", tiny.FAMILIES)
@pytest.mark.parametrize("drafter_role", DRAFTERS)
def test_speculative_greedy_equals_plain_greedy(zoo, family, drafter_role):
    for num_images, two_turns in CASES:
        messages = conversation(num_images, two_turns)
        plain = run(zoo, family, None, messages)
        speculative = run(zoo, family, drafter_role, messages, adaptive=num_images % 2 == 1)
        assert speculative.token_ids == plain.token_ids, (num_images, two_turns)
        assert speculative.stats.fallback_reason is None
        assert speculative.stats.mode == "speculative"
        assert len(plain.token_ids) == MAX_NEW


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_plain_greedy_equals_transformers_generate(zoo, family):
    target = zoo.target(family)
    messages = conversation(2)
    engine = Engine(target)
    prompt = engine.prepare(messages)
    with torch.inference_mode():
        out = target.model.generate(**prompt.target_inputs, max_new_tokens=MAX_NEW, do_sample=False,
                                    min_new_tokens=MAX_NEW)
    reference = out[0, prompt.target_inputs["input_ids"].shape[1]:].tolist()
    assert run(zoo, family, None, messages).token_ids == reference


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_same_weights_vlm_drafter_is_always_accepted_on_images(zoo, family):
    done = run(zoo, family, "same_vlm", conversation(2), k=4)
    assert done.stats.drafted > 0
    assert done.stats.acceptance == 1.0, done.stats
    assert done.stats.tokens_per_forward > 4


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_text_drafter_with_target_weights_is_always_accepted_on_text(zoo, family):
    done = run(zoo, family, "text_drafter", conversation(0), k=3)
    assert done.stats.acceptance == 1.0, done.stats
