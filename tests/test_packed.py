"""Float32 weights read from the GGUF blocks they came from (engine/packed.py): the blocks found
are ggml's, their values are the weights' bit for bit, and the compiled stack's passes over them
are bitwise its passes over the float32 weights, so answers do not change."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine import fast_decode, fast_native, packed
from engine.fast_decode import FastDecoder
from engine.runner import Runner
from tests.test_fast_decode import prompt_of
from tests.test_fast_native import NO_COMPILER, passes

QTYPES = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}


def from_gguf_blocks(weight: torch.Tensor, format: str) -> tuple[torch.Tensor, np.ndarray]:
    """weight (out, in) through gguf-py's own quantize and dequantize: (the float32 values a GGUF
    loader gives, the blocks' bytes as the file holds them)."""
    blocks = quants.quantize(weight.float().numpy(), QTYPES[format])
    return torch.from_numpy(quants.dequantize(blocks, QTYPES[format]).copy()), blocks


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("format", ("q4_1", "q8_0"))
def test_blocks_found_give_back_every_value_and_are_the_files_own(format):
    torch.manual_seed(0)
    weight = torch.randn(48, 96) * torch.logspace(-3, 1, 96)  # blocks of very different ranges
    values, file_blocks = from_gguf_blocks(weight, format)
    found = packed.pack(values.t())  # (in, out), as the fast path holds weights
    assert found is not None and found.format == format
    assert found.blocks.shape == (48, 3, packed.FORMATS[format])
    assert torch.equal(bits(packed.unpack(found.blocks, format)), bits(values))
    same = (found.blocks.reshape(-1, packed.FORMATS[format]).numpy()
            == file_blocks.reshape(-1, packed.FORMATS[format])).all(axis=1)
    assert same.mean() > 0.95  # where another float16 scale gives the same values it may differ


def test_weights_that_no_blocks_give_stay_float32():
    torch.manual_seed(1)
    assert packed.pack(torch.randn(64, 40)) is None  # trained float32 values
    values, _ = from_gguf_blocks(torch.randn(40, 64), "q4_1")
    assert packed.pack(values.t().to(torch.bfloat16)) is None  # not float32
    assert packed.pack(values[:, :32].t().contiguous()) is not None  # whole blocks
    assert packed.pack(values[:, :40].t()) is None  # rows of 40: not whole blocks
    changed = values.clone()
    changed[7, 33] = torch.nextafter(changed[7, 33], torch.tensor(9.0))  # one value one float step off
    assert packed.pack(changed.t()) is None


@NO_COMPILER
@pytest.mark.parametrize("format", ("q4_1", "q8_0"))
def test_a_product_over_blocks_is_bitwise_the_float32_product_on_every_kernel(format):
    native = fast_native.layer()
    torch.manual_seed(2)
    values, _ = from_gguf_blocks(torch.randn(70, 96) * 0.05, format)
    blocks = packed.pack(values.t()).blocks
    in_use = native.rows_kernel()
    try:
        for kernel in native.rows_kernels_built():
            native.use_rows_kernel(kernel)
            for n in (1, 2, 3, 4, 5, 8, 9, 17):
                x = torch.randn(n, 96)
                over_blocks = native.product(x, blocks, None)
                assert torch.equal(bits(over_blocks), bits(native.product(x, values.t(), None))), (kernel, n)
                one_by_one = torch.cat([native.product(x[i:i + 1], blocks, None) for i in range(n)])
                assert torch.equal(bits(one_by_one), bits(over_blocks)), (kernel, n)
    finally:
        native.use_rows_kernel(in_use)


def gguf_model(target):
    """A float32 copy of `target` whose decoder projections hold Q4_1 values and output layer Q8_0
    values, as a model loaded from such a GGUF file does."""
    target = copy.copy(target)
    target.model = copy.deepcopy(target.model).float()
    with torch.no_grad():
        for layer in fast_decode.text_stack(target.model).layers:
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
                linear = layer.get_submodule(name)
                linear.weight.copy_(from_gguf_blocks(linear.weight, "q4_1")[0])
        head = target.model.get_output_embeddings().weight
        head.copy_(from_gguf_blocks(head, "q8_0")[0])
    return target


@NO_COMPILER
def test_passes_over_blocks_are_bitwise_the_float32_passes(zoo, monkeypatch, one_thread):
    target = gguf_model(zoo.target("qwen2_vl"))
    logits = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("VLM_PACKED_WEIGHTS", setting)
        copied = copy.copy(target)
        copied.model = copy.deepcopy(target.model)
        runner = Runner(copied.model, copied.family)
        runner.fast = FastDecoder(copied.model, input_major=False)
        weights = [w for layer in runner.fast.stack.layers for w in
                   (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight)] + [runner.fast.head_weight]
        if setting == "1":
            assert all(isinstance(w, packed.PackedWeight) for w in weights)
            assert runner.fast.packed_bytes < sum(w.weight.numel() * 4 for w in weights) / 3
        else:
            assert not any(isinstance(w, packed.PackedWeight) for w in weights) and runner.fast.packed_bytes == 0
        logits[setting] = passes(runner, copied)  # decode, verify, a draft tree, rollback, decode
    for off, on in zip(logits["0"], logits["1"]):
        assert torch.equal(bits(off), bits(on))


@NO_COMPILER
def test_quantizing_a_packed_model_starts_from_its_float32_values(zoo):
    target = gguf_model(zoo.target("qwen2_vl"))
    decoder = FastDecoder(copy.deepcopy(target.model), input_major=False)
    assert decoder.packed_bytes > 0
    reference = FastDecoder(copy.deepcopy(target.model), input_major=False)
    decoder.quantize("int8")
    reference.stack.layers = [layer if not isinstance(layer.qkv_weight, packed.PackedWeight) else
                              fast_decode.Layer(layer.input_norm, layer.qkv_weight.weight, layer.qkv_bias,
                                                layer.o_weight.weight, layer.o_bias, layer.post_norm,
                                                layer.gate_up_weight.weight, layer.down_weight.weight)
                              for layer in reference.stack.layers]
    reference.head_weight = reference.head_weight.weight
    reference.quantize("int8")
    assert decoder.packed_bytes == 0
    assert torch.equal(decoder.stack.layers[1].down_weight.values, reference.stack.layers[1].down_weight.values)


@NO_COMPILER
def test_picture_weights_over_blocks_are_low_rank_updates_that_verify_bitwise(zoo, one_thread):
    """A picture runner over packed text weights (engine/target.py adapt_packed): the same blocks plus
    each update (x down) up on its own; what the merged weights compute, to float rounding; its
    verify passes bitwise its decode passes; its Python reference the same to float rounding."""
    from engine.target import adapt_packed
    from models.picture_weights import picture_model

    target = gguf_model(zoo.target("qwen2_vl"))
    generator = torch.Generator().manual_seed(3)
    deltas = {}
    for index, layer in enumerate(fast_decode.text_stack(target.model).layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                     "mlp.up_proj", "mlp.down_proj"):
            weight = layer.get_submodule(name).weight
            key = f"model.language_model.layers.{index}.{name}"
            deltas[f"{key}.lora_A"] = torch.randn(3, weight.shape[1], generator=generator) * 0.3
            deltas[f"{key}.lora_B"] = torch.randn(weight.shape[0], 3, generator=generator) * 0.3
    merged = copy.copy(target)
    merged.model = picture_model(target.model, deltas)
    runners = [Runner(model, target.family) for model in (copy.deepcopy(target.model), merged.model)]
    for runner in runners:
        runner.fast = FastDecoder(runner.model, input_major=False)
    reference = passes(runners[1], merged)  # the merged float32 weights
    adapt_packed(runners, "tiny", deltas)
    layers = runners[1].fast.stack.layers
    assert all(isinstance(getattr(layer, name), packed.Adapted) for layer in layers for name in fast_decode.PRODUCTS)
    assert layers[0].qkv_weight.down.shape == (64, 16)  # ranks 3 + 3 + 3, padded to 16 lanes
    assert layers[0].qkv_weight.base is runners[0].fast.stack.layers[0].qkv_weight  # the text runner's blocks
    adapted = passes(runners[1], merged)
    for new, old in zip(adapted, reference):
        torch.testing.assert_close(new, old, atol=5e-5, rtol=5e-5)
    logits, state = runners[1].prefill(prompt_of(merged, 1).target_inputs)
    one_by_one = [runners[1].extend(state, [token]) for token in (5, 9, 11, 7)]
    runners[1].rollback(state, 4)
    together = runners[1].extend(state, [5, 9, 11, 7])
    assert torch.equal(bits(torch.cat(one_by_one)), bits(together))
    runners[1].fast.stack.native = None  # the Python reference, same weights
    for new, old in zip(passes(runners[1], merged), adapted):
        torch.testing.assert_close(new, old, atol=5e-5, rtol=5e-5)
