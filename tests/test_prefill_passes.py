"""A long prompt is read in passes that a Stop can end (engine/runner.py `prefill_bounds`): where
the passes fall, that reading in passes gives the one-pass result on a real tiny VLM with an
image, and that a stop set during the read ends it after the pass under way, with no answer."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.engine import Engine
from engine.loop import DecodeSettings, Done, generate
from engine.runner import NO_READS, PREFILL_CHUNK, Runner, TargetReads, prefill_bounds
from engine.sampling import SamplingSettings
from models import tiny


def test_the_passes_of_a_long_prompt():
    text = {"input_ids": torch.zeros(1, 1200, dtype=torch.long)}
    assert prefill_bounds(text, set(), NO_READS) == [(0, 512), (512, 1024), (1024, 1200)]
    assert prefill_bounds({"input_ids": torch.zeros(1, PREFILL_CHUNK, dtype=torch.long)}, set(), NO_READS) == [(0, 512)]
    pictured = {"input_ids": torch.zeros(1, 1200, dtype=torch.long), "pixel_values": torch.zeros(4, 8)}
    pictured["input_ids"][0, 690:701] = 7  # the image's tokens: the first pass reads past them
    assert prefill_bounds(pictured, {7}, NO_READS) == [(0, 701), (701, 1200)]
    assert prefill_bounds(pictured, {9}, NO_READS) == [(0, 1200)]  # no placeholder known: one pass
    masked = {**text, "attention_mask": torch.ones(1, 1200, dtype=torch.long)}
    masked["attention_mask"][0, 0] = 0
    assert prefill_bounds(masked, set(), NO_READS) == [(0, 1200)]
    assert prefill_bounds(text, set(), TargetReads(shared_kv=True)) == [(0, 1200)]


def long_prompt(target):
    content = [{"type": "image", "image": tiny.tiny_images(1, seed=3)[0]},
               {"type": "text", "text": "Say more about the picture and the sky. " * 120}]
    prompt = Engine(target).prepare([{"role": "user", "content": content}])
    assert len(prompt.input_ids) > 2 * PREFILL_CHUNK
    return prompt


def test_a_long_prompt_read_in_passes_gives_the_one_pass_result(zoo, monkeypatch):
    target = zoo.target("qwen2_vl")
    prompt = long_prompt(target)
    runner = Runner(target.model, target.family, fast=False)
    reads = TargetReads(hidden_layers=(1, -1))
    logits, state = runner.prefill(prompt.target_inputs, reads)
    monkeypatch.setattr("engine.runner.PREFILL_CHUNK", 10**6)
    whole_logits, whole = runner.prefill(prompt.target_inputs, reads)
    assert int(logits.argmax()) == int(whole_logits.argmax())
    torch.testing.assert_close(logits, whole_logits, atol=1e-4, rtol=1e-4)
    assert state.cache_len == whole.cache_len and state.rope_pos == whole.rope_pos
    for layer in reads.hidden_layers:
        assert state.hidden[layer].shape == whole.hidden[layer].shape == (len(prompt.input_ids), state.hidden[layer].shape[-1])
        torch.testing.assert_close(state.hidden[layer], whole.hidden[layer], atol=1e-4, rtol=1e-4)


def test_a_stop_during_a_long_prompt_read_ends_it_after_the_pass_under_way(zoo):
    target = zoo.target("qwen2_vl")
    prompt = long_prompt(target)
    runner = Runner(target.model, target.family)
    stop, passes = threading.Event(), []
    forward = target.model.forward

    def one_pass(*args, **kwargs):
        passes.append(kwargs["input_ids"].shape[1])
        stop.set()  # Stop pressed while the first pass runs
        return forward(*args, **kwargs)

    target.model.forward = one_pass
    try:
        events = list(generate(runner, target.tokenizer, prompt, None, SamplingSettings(), DecodeSettings(), stop))
    finally:
        del target.model.forward
    assert len(passes) == 1 and passes[0] < len(prompt.input_ids)
    assert len(events) == 1 and isinstance(events[0], Done)
    assert events[0].token_ids == [] and events[0].stats.finish_reason == "stopped" and events[0].stats.new_tokens == 0
