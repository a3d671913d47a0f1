"""Speculative greedy == plain greedy, token for token, in float32, for every family x drafter
kind, with 0, 1, 2 and 4 images and a two-turn chat, with chains and with draft trees; plain greedy == transformers' generate();
a drafter with the target's own weights is always accepted (the proof that positions are right)."""

from __future__ import annotations

import os

import pytest
import torch

from engine.engine import Engine
from engine.loop import DecodeSettings, Done
from measure.exactness import CASES, DRAFTERS, MAX_NEW, conversation, run
from models import tiny
from tests.oracles import uncached_forward

SLIDING_WINDOW = ("gemma3",)
# scripts/test.sh runs this file again with VLM_NATIVE_LAYER=0, the path of a machine without a C++
# compiler (the fast path's Python layer on its own weight layout), for one M-RoPE family and one
# Llama one: the families without the fast path run as in the first run.
WITHOUT_COMPILER = ("qwen2_vl", "idefics3")


@pytest.fixture(autouse=True)
def once_more_without_compiler(request):
    family = request.node.callspec.params.get("family") if hasattr(request.node, "callspec") else None
    if os.environ.get("VLM_NATIVE_LAYER") == "0" and family not in WITHOUT_COMPILER:
        pytest.skip(f"VLM_NATIVE_LAYER=0 reruns {' and '.join(WITHOUT_COMPILER)} only")


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
        if num_images == 4:
            continue  # trees: 0, 1, 2 images and the two-turn chat
        tree = run(zoo, family, drafter_role, messages, adaptive=num_images % 2 == 1, draft_tree=6)
        assert tree.token_ids == plain.token_ids, ("tree", num_images, two_turns)
        assert tree.stats.fallback_reason is None
        if family in SLIDING_WINDOW:  # Gemma 3: chains, with the reason
            assert tree.stats.draft_shape == "chain" and "sliding-window" in tree.stats.tree_fallback
        else:
            assert tree.stats.draft_shape == "tree" and tree.stats.tree_fallback is None


def teacher_forced_choices(target, prompt, answer_ids):
    """The target's greedy choice at every answer position from ONE forward over prompt + answer
    with no cache, positions computed by the model itself: the ground truth for plain greedy.
    An answer token that is an image placeholder cannot be fed back without an image, so the
    choices stop at the first one (random tiny models do emit them)."""
    fed = next((i for i, t in enumerate(answer_ids) if t in target.placeholder_ids), len(answer_ids) - 1)
    answer_ids = answer_ids[:fed]  # the choices cover positions 0..fed
    logits = uncached_forward(target, prompt, answer_ids).logits[0]
    start = prompt.target_inputs["input_ids"].shape[1] - 1
    return logits[start:start + len(answer_ids) + 1].argmax(-1).tolist()


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_plain_greedy_equals_teacher_forced_forward(zoo, family):
    target = zoo.target(family)
    for num_images, two_turns in CASES:
        messages = conversation(num_images, two_turns)
        ids = run(zoo, family, None, messages).token_ids
        truth = teacher_forced_choices(target, Engine(target).prepare(messages), ids)
        assert ids[:len(truth)] == truth, (num_images, two_turns)


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_plain_greedy_equals_transformers_generate(zoo, family):
    """Equal to generate() greedy; where they part, generate() is the one that left the
    teacher-forced ground truth (seen with transformers 5.24 on Qwen2-VL and Gemma 3)."""
    target = zoo.target(family)
    messages = conversation(2)
    prompt = Engine(target).prepare(messages)
    with torch.inference_mode():
        out = target.model.generate(**prompt.target_inputs, max_new_tokens=MAX_NEW, do_sample=False,
                                    min_new_tokens=MAX_NEW)
    reference = out[0, prompt.target_inputs["input_ids"].shape[1]:].tolist()
    ours = run(zoo, family, None, messages).token_ids
    if ours != reference:
        first = next(i for i, (a, b) in enumerate(zip(ours, reference)) if a != b)
        truth = teacher_forced_choices(target, prompt, reference[:first + 1])
        assert truth[first] == ours[first] != reference[first]
        pytest.xfail(f"transformers generate() leaves greedy at token {first} on {family}; the engine does not")


def rounds(events):
    """(drafted, accepted, tokens of the round) for each verify round of an answer."""
    done = events[-1]
    return [(k, chunk.origins.count("draft"), chunk.token_ids)
            for k, chunk in zip(done.stats.draft_lengths, events[1:-1])]


def assert_only_placeholder_rejections(events, placeholder_ids):
    """Every drafted token was accepted, except where the target itself chose an image
    placeholder id, which drafters never propose (random tiny models do emit them)."""
    for drafted, accepted, tokens in rounds(events):
        if accepted < drafted and accepted < len(tokens):
            assert tokens[accepted] in placeholder_ids, (drafted, accepted, tokens)
    assert events[-1].stats.acceptance > 0.5


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_same_weights_vlm_drafter_is_always_accepted_on_images(zoo, family):
    events = run(zoo, family, "same_vlm", conversation(2), k=4, events=True)
    assert_only_placeholder_rejections(events, zoo.target(family).placeholder_ids)


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_text_drafter_with_target_weights_is_always_accepted_on_text(zoo, family):
    events = run(zoo, family, "text_drafter", conversation(0), k=3, events=True)
    assert_only_placeholder_rejections(events, zoo.target(family).placeholder_ids)


def test_small_drafters_run_in_float32_on_a_cpu_under_a_bfloat16_target(zoo):
    """drafter_dtype "auto": a small drafter on a CPU runs in float32 (faster there) while the
    target stays in bfloat16; an explicit drafter_dtype is kept. The float32 drafter's drafts
    are verified by the bfloat16 target like any other."""
    from engine.drafters.registry import load_drafter
    from engine.target import load_target
    from models.loading import LoadOptions

    bf16 = LoadOptions(dtype="bfloat16", device="cpu")
    target = load_target(str(zoo.dir("qwen2_vl")), bf16)
    text = load_drafter(str(zoo.dir("qwen2_vl", "text_drafter")), target, bf16)
    vlm = load_drafter(str(zoo.dir("qwen2_vl", "vlm_drafter")), target, bf16)
    kept = load_drafter(str(zoo.dir("qwen2_vl", "vlm_drafter")), target,
                        LoadOptions(dtype="bfloat16", device="cpu", drafter_dtype="bfloat16"))
    assert target.model.dtype == torch.bfloat16
    assert text.runner.model.dtype == vlm.runner.model.dtype == torch.float32
    assert kept.runner.model.dtype == torch.bfloat16
    engine = Engine(target, {"text": text})
    decode = DecodeSettings(max_new_tokens=MAX_NEW, draft_tokens=4, stop_token_ids=frozenset({-1}))
    messages = conversation(2)
    plain = [e for e in engine.stream(messages, drafter=None, decode=decode) if isinstance(e, Done)][0]
    done = [e for e in engine.stream(messages, drafter="text", decode=decode) if isinstance(e, Done)][0]
    assert len(done.token_ids) == len(plain.token_ids) == MAX_NEW
    assert done.stats.accepted > 0  # the text drafter has the target's own language weights
