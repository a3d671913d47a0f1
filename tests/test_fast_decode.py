"""The hand-written decode forward (engine/fast_decode.py) against transformers' forward, which
the Runner uses with fast=False: same float32 logits (within 1e-5, absolute plus relative: the
compiled stack sums in another order than transformers' kernels), same greedy tokens, for decode,
verify, rollback, draft trees and hidden-state reads; uncovered families named."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from engine.runner import Runner, TargetReads
from engine.static_cache import StaticKVCache
from models import tiny

COVERED = ("qwen2_vl", "qwen2_5_vl", "idefics3", "smolvlm", "llava")
ATOL = RTOL = 1e-5


def prompt_of(target, num_images: int):
    images = tiny.tiny_images(num_images, seed=3)
    content = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": "Say more."}]
    return Engine(target).prepare([{"role": "user", "content": content}])


def pair(target, reads=TargetReads()):
    """(today's Runner, the fast one), each prefilled on the same one-image prompt; first token."""
    prompt = prompt_of(target, 1)
    runners = Runner(target.model, target.family, fast=False), Runner(target.model, target.family)
    assert runners[1].fast is not None, runners[1].fast_fallback
    (logits, old), (_, new) = (runner.prefill(prompt.target_inputs, reads) for runner in runners)
    assert isinstance(new.cache, StaticKVCache)
    return runners, (old, new), int(logits.argmax())


def both(runners, states, call, *args):
    """The same call on both runners; their results (close) and the fast one's."""
    old, new = (getattr(runner, call)(state, *args) for runner, state in zip(runners, states))
    if old is not None:
        torch.testing.assert_close(new, old, atol=ATOL, rtol=RTOL)
    return new


@pytest.mark.parametrize("family", COVERED)
def test_decode_verify_rollback_match_transformers(zoo, family, one_thread):
    runners, states, token = pair(zoo.target(family))
    answer = [token]
    for _ in range(12):  # plain decoding
        answer.append(int(both(runners, states, "extend", [answer[-1]])[-1].argmax()))
    for kept in (0, 2, 4):  # a verify pass over 5 tokens, then a partial rejection
        both(runners, states, "extend", answer[-5:])
        both(runners, states, "rollback", 5 - kept)
    assert states[0].cache_len == states[1].cache_len == states[1].cache.length
    both(runners, states, "extend", [answer[-1], answer[-2]])


@pytest.mark.parametrize("family", ("qwen2_vl", "idefics3"))
def test_tree_pass_and_keep_path_match_transformers(zoo, family, one_thread):
    runners, states, token = pair(zoo.target(family))
    # the root, then children a, x of the root and b of a (engine/tree.py's layout)
    both(runners, states, "extend_tree", [token, 7, 9, 11], [-1, 0, 0, 1])
    both(runners, states, "keep_path", [0, 2])
    both(runners, states, "extend_tree", [13, 7], [-1, -1])
    both(runners, states, "keep_path", [1])
    both(runners, states, "extend", [5, 6, 7])


def test_hidden_reads_match_transformers(zoo, one_thread):
    runners, states, token = pair(zoo.target("qwen2_vl"), TargetReads(hidden_layers=(0, 1, -1)))
    for tokens in ([token], [token, 8, 9]):
        both(runners, states, "extend", tokens)
        old, new = (state.hidden for state in states)
        assert sorted(new) == sorted(old) == [-1, 0, 1]
        for layer in old:
            torch.testing.assert_close(new[layer], old[layer], atol=ATOL, rtol=0)


def test_greedy_answers_equal_with_and_without_the_fast_path(zoo, one_thread):
    target = zoo.target("smolvlm")
    messages = [{"role": "user", "content": [{"type": "image", "image": tiny.tiny_images(1)[0]},
                                             {"type": "text", "text": "Describe it."}]}]
    answers = [list(Engine(replace(target, runner=Runner(target.model, target.family, fast=fast))).stream(messages))[-1]
               for fast in (False, True)]
    assert answers[0].token_ids == answers[1].token_ids and len(answers[0].token_ids) > 1


@pytest.mark.parametrize("family", ("qwen3_vl", "gemma3"))
def test_uncovered_families_keep_transformers_forward_and_say_why(zoo, family):
    runner = Runner(zoo.target(family).model, zoo.target(family).family)
    assert runner.fast is None and runner.fast_fallback


def test_static_cache_grows_past_its_capacity_and_moves_entries():
    cache = StaticKVCache(num_layers=1, kv_heads=1, head_dim=2, capacity=3, dtype=torch.float32, device="cpu")
    cache.reserve(3)
    cache.keys[0][0, 0, :3] = cache.values[0][0, 0, :3] = torch.arange(6.0).view(3, 2)
    cache.length = 3
    cache.reserve(2)  # 5 > 3: doubled, entries kept
    assert cache.capacity == 6 and cache.keys[0][0, 0, :3].tolist() == [[0, 1], [2, 3], [4, 5]]
    cache.move(1, torch.tensor([2]))
    cache.crop(-1)
    assert cache.length == 2 and cache.values[0][0, 0, :2].tolist() == [[0, 1], [4, 5]]
    with pytest.raises(ValueError):
        cache.crop(1)


def test_demo_model_greedy_decode_and_verify_match_transformers(one_thread):
    """The bundled model (Qwen2-VL, trained): 30 greedy steps and a verify pass, per request."""
    from engine.target import load_target
    from measure.bench import demo_requests, request_messages

    target = load_target(str(Path(__file__).parents[1] / "assets" / "demo" / "target"))
    engine = Engine(target)
    for request in demo_requests(2):
        prompt = engine.prepare(request_messages(request))
        runners = Runner(target.model, target.family, fast=False), Runner(target.model, target.family)
        (logits, old), (_, new) = (runner.prefill(prompt.target_inputs) for runner in runners)
        answer = [int(logits.argmax())]
        for _ in range(30):
            answer.append(int(both(runners, (old, new), "extend", [answer[-1]])[-1].argmax()))
        both(runners, (old, new), "extend", answer[-6:])


@pytest.mark.parametrize("input_major", (True, False))
def test_bfloat16_weights_become_views_of_the_fused_buffers(zoo, input_major):
    """Same values, one copy: the model's Linear weights view the fast path's buffers, (in, out)
    (torch's kernels) or (out, in) (the compiled stack's rows kernel)."""
    import copy

    from engine import fast_decode

    model = copy.deepcopy(zoo.target("idefics3").model).to(torch.bfloat16)
    attn = fast_decode.text_stack(model).layers[0].self_attn
    before = attn.k_proj.weight.clone()
    decoder = fast_decode.FastDecoder(model, input_major)
    fused = decoder.stack.layers[0].qkv_weight  # (in, out) as linear takes it
    assert fused.is_contiguous() == input_major and fused.t().is_contiguous() != input_major
    assert attn.k_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert torch.equal(attn.k_proj.weight, before)
