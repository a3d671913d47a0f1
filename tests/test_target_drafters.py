"""Drafters that read the target, and hybrid targets, on tiny random-weight models (float32, greedy).

For every family of tests/tiny_next.py, with 0, 1 and 2 images:
- exactness: speculative greedy == plain greedy, token for token;
- forced acceptance: random drafters accept almost nothing, so a drafter is made to propose
  the true greedy continuation with one token corrupted every few positions; each round must
  accept exactly the draft's prefix up to the corruption, round after round, and the answer
  must stay the plain one. For drafters with their own state (MTP, DFlash, assistants) the
  real drafter runs and only its token choice is forced (`ForcedSampler`), so its caches and
  positions go through every acceptance length.
"""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.loop import DecodeSettings, Done
from engine.runner import Runner
from models.loading import LoadOptions, load_target
from tests import tiny, tiny_next
from tests.mocks import ScriptedDrafter

FLOAT32 = LoadOptions(dtype="float32", device="cpu")
MAX_NEW = 24
IMAGE_COUNTS = (0, 1, 2)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Zoo:
    def __init__(self, root):
        self.root, self.targets = root, {}

    def target(self, family: str):
        if family not in self.targets:
            folder = tiny_next.build_target(family, self.root / family)
            self.targets[family] = load_target(str(folder), FLOAT32)
        return self.targets[family]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return Zoo(tmp_path_factory.mktemp("tiny-next"))


def messages(num_images: int):
    images = tiny.tiny_images(num_images, seed=num_images)
    content = [{"type": "image", "image": image} for image in images]
    return [{"role": "user", "content": content + [{"type": "text", "text": "Describe what you see, then say more."}]}]


def answer(target, num_images, drafter=None, k=4, adaptive=False) -> Done:
    engine = Engine(target, {"drafter": drafter} if drafter else {})
    decode = DecodeSettings(max_new_tokens=MAX_NEW, draft_tokens=k, adaptive=adaptive, stop_token_ids=frozenset({-1}))
    done = list(engine.stream(messages(num_images), drafter="drafter" if drafter else None, decode=decode))[-1]
    assert isinstance(done, Done)
    return done


def corrupt(truth: list[int], every: int = 7, first: int = 3) -> list[int]:
    """The true answer with token first, first + every, ... replaced by another id."""
    corrupted = list(truth)
    for i in range(first, len(corrupted), every):
        corrupted[i] = corrupted[i] + 1 if corrupted[i] + 1 != truth[i] else corrupted[i] + 2
    return corrupted


def expected_accepts(truth: list[int], proposed: list[int], draft_lengths: list[int]) -> list[int]:
    """Replay: each round accepts the longest prefix of its draft that equals the truth, then
    the target adds one token. The first answer token comes from prefill."""
    position, accepts = 1, []
    for k in draft_lengths:
        draft = proposed[position:position + k]
        accepted = 0
        while accepted < len(draft) and draft[accepted] == truth[position + accepted]:
            accepted += 1
        accepts.append(accepted)
        position += accepted + 1
    return accepts


def assert_forced_acceptance(done: Done, truth: list[int], proposed: list[int], accepted: list[int]):
    assert done.token_ids == truth
    assert accepted == expected_accepts(truth, proposed, done.stats.draft_lengths)
    assert 0 < done.stats.accepted < done.stats.drafted  # both full and partial acceptances happened


# Hybrid target (Qwen3.5): rollback of the recurrent state, with drafters that do not read the target.


@pytest.mark.parametrize("num_images", IMAGE_COUNTS)
def test_hybrid_plain_greedy_equals_one_uncached_forward(zoo, num_images):
    target = zoo.target("qwen3_5")
    ids = answer(target, num_images).token_ids
    prompt = Engine(target).prepare(messages(num_images))
    inputs = dict(prompt.target_inputs)
    tail = torch.tensor([ids[:-1]])
    inputs["input_ids"] = torch.cat([inputs["input_ids"], tail], 1)
    inputs["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(tail)], 1)
    inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(tail)], 1)
    target.model.model.rope_deltas = None
    with torch.inference_mode():
        logits = target.model(**inputs).logits[0]
    start = prompt.target_inputs["input_ids"].shape[1] - 1
    assert logits[start:].argmax(-1).tolist() == ids


@pytest.mark.parametrize("num_images", IMAGE_COUNTS)
def test_hybrid_ngram_speculation_equals_plain(zoo, num_images):
    from engine.drafters.ngram import NgramDrafter

    target = zoo.target("qwen3_5")
    plain = answer(target, num_images)
    speculative = answer(target, num_images, NgramDrafter(), adaptive=True)
    assert speculative.token_ids == plain.token_ids
    assert speculative.stats.fallback_reason is None


@pytest.mark.parametrize("num_images", IMAGE_COUNTS)
@pytest.mark.parametrize("k, adaptive", [(4, False), (3, True)])
def test_hybrid_forced_acceptance(zoo, num_images, k, adaptive):
    target = zoo.target("qwen3_5")
    truth = answer(target, num_images).token_ids
    proposed = corrupt(truth)
    drafter = ScriptedDrafter(proposed)
    done = answer(target, num_images, drafter, k=k, adaptive=adaptive)
    assert_forced_acceptance(done, truth, proposed, drafter.accepted)


def test_hybrid_rollback_is_needed(zoo):
    """Power check: the same forced drafts with a plain Runner (crop only, the recurrent state
    keeps the rejected tokens) change the answer."""
    target = zoo.target("qwen3_5")
    truth = answer(target, 1).token_ids
    hybrid_runner, target.runner = target.runner, Runner(target.model, target.family)
    try:
        done = answer(target, 1, ScriptedDrafter(corrupt(truth)))
    finally:
        target.runner = hybrid_runner
    assert done.token_ids != truth
