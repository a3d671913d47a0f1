"""The weights' arena on 2 MB pages (engine/huge_pages.py): values kept, each weight where the
compiled stack streams it, one buffer for a model's layers and output layer; and the weights file
unmapped once the few weights left on it are copied out (models/loading.py)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine import fast_decode, fast_native
from engine.huge_pages import HUGE_PAGE, HugePageArena
from models.loading import copy_out_of_weight_files


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


def mapped(path) -> bool:
    with open("/proc/self/maps") as maps:
        return any(line.rstrip().endswith(str(path)) for line in maps)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
def test_a_weights_file_goes_once_its_few_remaining_tensors_are_copied_out_and_stays_while_mostly_used(tmp_path):
    """As transformers loads (safetensors' mmap backend: each tensor a view of the file's mapping):
    a module whose big weight went elsewhere (the arena) keeps a small one on the file; copied out,
    the same Parameter holds the same values and the file is unmapped. A module that still uses
    most of its file keeps it mapped, nothing copied."""
    path = tmp_path / "model.safetensors"
    save_file({"big": torch.randn(1024, 1024), "small": torch.randn(64)}, str(path))
    with safe_open(str(path), "pt", device="cpu", backend="mmap") as weights:
        mostly_used, few_left = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
        mostly_used.weight = torch.nn.Parameter(weights.get_slice("big")[:], requires_grad=False)
        few_left.bias = torch.nn.Parameter(weights.get_slice("small")[:], requires_grad=False)
        few_left.register_buffer("table", weights.get_slice("small")[:8])
    small, table, bias = few_left.bias.clone(), few_left.table.clone(), few_left.bias
    assert mapped(path)
    assert copy_out_of_weight_files([mostly_used]) == 0 and mapped(path)
    del mostly_used
    assert copy_out_of_weight_files([few_left, few_left]) == (64 + 8) * 4
    assert few_left.bias is bias and torch.equal(few_left.bias, small) and torch.equal(few_left.table, table)
    assert not mapped(path)
