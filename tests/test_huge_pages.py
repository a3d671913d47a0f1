"""The weights' arena on 2 MB pages (engine/huge_pages.py): values kept, each weight where the
compiled stack streams it, one buffer for a model's layers and output layer."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import fast_decode, fast_native
from engine.huge_pages import HUGE_PAGE, HugePageArena


def test_placed_tensors_keep_their_values_start_on_cache_lines_and_the_arena_on_a_2_mb_page():
    tensors = [torch.randn(5, 7), torch.randn(33, 64).to(torch.bfloat16), torch.arange(3, dtype=torch.int8)]
    arena = HugePageArena(HugePageArena.size_of(tensors))
    placed = [arena.place(t) for t in tensors]
    assert arena.buffer.data_ptr() % HUGE_PAGE == 0
    for before, after in zip(tensors, placed):
        assert after.dtype == before.dtype and torch.equal(after, before) and after.data_ptr() % 64 == 0
    assert arena.used == arena.buffer.numel()
    with pytest.raises(ValueError, match="do not fit"):
        arena.place(torch.zeros(1))


@pytest.mark.skipif(fast_native.layer() is None, reason="no compiled stack on this machine")
def test_the_compiled_stack_streams_every_weight_from_one_arena(zoo, monkeypatch):
    model = copy.deepcopy(zoo.target("qwen2_vl").model).to(torch.bfloat16)
    before = fast_decode.text_stack(model).layers[1].mlp.down_proj.weight.clone()
    decoder = fast_decode.FastDecoder(model, input_major=False)
    weights = [w for layer in decoder.stack.layers
               for w in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight)]
    storages = {w.untyped_storage().data_ptr() for w in [*weights, decoder.head_weight]}
    assert len(storages) == 1 and weights[0].data_ptr() % HUGE_PAGE == 0  # the first placed starts the arena
    assert torch.equal(fast_decode.text_stack(model).layers[1].mlp.down_proj.weight, before)
    monkeypatch.setenv("VLM_HUGE_PAGES", "0")  # off: each fused buffer its own
    plain = fast_decode.FastDecoder(copy.deepcopy(zoo.target("qwen2_vl").model).to(torch.bfloat16), input_major=False)
    assert len({layer.down_weight.untyped_storage().data_ptr() for layer in plain.stack.layers}) == len(plain.stack.layers)
