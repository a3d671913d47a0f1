"""Ground truth for cached decoding: the target run once, uncached, over prompt + answer."""

from __future__ import annotations

import torch


def uncached_forward(target, prompt, answer_ids: list[int], **kwargs):
    """ONE forward of the target over prompt + answer_ids, without a cache, positions computed
    by the model itself: the ground truth for the cached, rolled-back passes."""
    inputs = uncached_inputs(prompt, answer_ids)
    if hasattr(target.model.model, "rope_deltas"):
        target.model.model.rope_deltas = None  # the model's own stored state must not leak in
    with torch.inference_mode():
        return target.model(**inputs, **kwargs)


def uncached_inputs(prompt, answer_ids: list[int]) -> dict:
    """The target's inputs for prompt + answer_ids in one sequence (images included)."""
    inputs = dict(prompt.target_inputs)
    answer = torch.tensor([answer_ids], dtype=torch.long)
    inputs["input_ids"] = torch.cat([inputs["input_ids"], answer], 1)
    for name in ("attention_mask", "mm_token_type_ids", "token_type_ids"):
        if name in inputs:
            pad = torch.ones_like(answer) if name == "attention_mask" else torch.zeros_like(answer)
            inputs[name] = torch.cat([inputs[name], pad.to(inputs[name].dtype)], 1)
    return inputs
