"""`--quantization q4_0`: llama.cpp's Q4_0 weights times int8 activations (engine/quantized.py's
Q4Weight, the reference; engine/fast_q4.h, the compiled kernels). The weights are quantized as
llama.cpp quantizes them (gguf-py's quantizer, bit for bit); the products' integer lanes are exact
and their float lanes summed in a fixed order, so: the compiled product is bitwise the Python
reference's, with every kernel (AVX512-VNNI, portable), for any number of rows and threads; a verify
pass over up to the most rows the settings allow is bitwise its one-token passes; speculative greedy
answers are the plain ones; a slower kernel is named with its reason."""

from __future__ import annotations

import copy
import logging
import numpy as np
import pytest
import torch

from engine import fast_native
from engine.linear_attention_rollback import runner_for
from engine.quantized import Q4Weight, quantize_q4_0, quantized_linear
from engine.target import quantize_fast
from models.loading import LoadError
from tests.test_fast_native import NO_COMPILER, assert_verify_is_decode
from tests.test_w8a8 import int8_kernel  # noqa: F401 (a fixture: both kernels)
from tests.test_w8a8 import (SHAPES, assert_kernels_and_python_agree, assert_product_rows, assert_speculative_is_plain,
                             each_kernel_and_size)


def q4_target(zoo, dtype, family="qwen2_vl"):
    """A copy of a tiny target in `dtype`, its fast path on Q4_0 weights."""
    target = copy.copy(zoo.target(family))
    target.model = copy.deepcopy(target.model).to(dtype)
    target.runner = runner_for(target.model, target.family)
    target.runner.fast.quantize("q4_0")
    return target


def awkward_weight(out: int, width: int, seed: int) -> torch.Tensor:
    """(out, width) float32 with the blocks llama.cpp's rounding meets: ties for the largest |w|
    (the first wins), an all-zero block, a block of one tiny value, halfway codes."""
    weight = torch.randn(out, width, generator=torch.Generator().manual_seed(seed))
    weight[0, :32] = torch.tensor([0.5, -0.5] * 16)
    weight[1, :32] = 0.0
    weight[2, 32:64] = 0.0
    weight[2, 40] = 1e-30
    weight[3, :32] = torch.arange(32) / 2 - 8  # x / d + 8.5 lands on .5 and whole numbers
    return weight


def test_the_weights_are_llama_cpps_q4_0():
    """Codes, scales and the weights they stand for are gguf-py's Q4_0 (llama.cpp's
    quantize_row_q4_0_ref in numpy), bit for bit."""
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    weight = awkward_weight(37, 96, seed=1)
    blocks = quants.quantize(weight.numpy(), GGMLQuantizationType.Q4_0).reshape(37, 3, 18)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0]
    codes = np.concatenate([blocks[..., 2:] & 15, blocks[..., 2:] >> 4], axis=-1).reshape(37, 96)
    ours_codes, ours_scales = quantize_q4_0(weight)
    assert np.array_equal(ours_codes.numpy(), codes)
    assert np.array_equal(ours_scales.numpy().view(np.uint16), scales.view(np.uint16))
    quantized = Q4Weight.quantize(weight.to(torch.bfloat16).float().t())  # (in, out), as linear takes it
    assert quantized.codes.shape == (37, 64) and quantized.scales.shape == (37, 4)  # 96 padded to 128
    dequantized = quants.dequantize(quants.quantize(weight.to(torch.bfloat16).float().numpy(),
                                                    GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0)
    ours = quantized.values().float() * quantized.scales.float().repeat_interleave(32, dim=1)
    assert np.array_equal(ours[:, :96].numpy(), dequantized) and not ours[:, 96:].any()


def test_a_width_that_is_not_whole_blocks_is_refused(zoo):
    with pytest.raises(ValueError, match="multiple of 32"):
        Q4Weight.quantize(torch.randn(48, 8))
    target = copy.copy(zoo.target("qwen2_vl"))
    target.runner = runner_for(copy.deepcopy(target.model), target.family)
    target.runner.fast.stack.layers[0].o_weight = torch.randn(40, 64)  # as a model with 40 inputs would have
    with pytest.raises(LoadError, match="--quantization q4_0 on 'tiny'.*multiple of 32"):
        quantize_fast(target.runner, "tiny", "q4_0")


@NO_COMPILER
@pytest.mark.parametrize("int8_kernel", ("avx512-vnni", "portable"), indirect=True)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("out, width", [(1031, 2048), (37, 96)], ids=("2048 wide", "tails"))
def test_the_compiled_product_is_the_reference_bitwise(int8_kernel, dtype, out, width):
    """A 2048-wide weight, and one whose width leaves a half step of 64 inputs and whose outputs leave
    a tail after the 4-output blocks, with llama.cpp's awkward blocks: tests/test_w8a8.py's
    assert_product_rows, against the float64 product of the weights the codes stand for."""
    generator = torch.Generator().manual_seed(out)
    weight = awkward_weight(out, width, seed=out).to(dtype).t()  # (in, out) view of (out, in)
    quantized = Q4Weight.quantize(weight)
    dequantized = (quantized.values().double() * quantized.scales.double().repeat_interleave(32, dim=1))[:, :width]
    bias = torch.randn(out, generator=generator).to(dtype)
    assert_product_rows(lambda x: int8_kernel.product(x, quantized.codes, bias, quantized.scales),
                        lambda x: quantized_linear(x, quantized, bias),
                        lambda x: x.double() @ dequantized.t() + bias.double(), width, dtype, generator)


@each_kernel_and_size
def test_a_verify_pass_is_bitwise_the_decode_passes(zoo, dtype, rows, int8_kernel):
    """As tests/test_fast_native.py's, for both kernels."""
    assert_verify_is_decode((target := q4_target(zoo, dtype)).runner, target, rows)


@NO_COMPILER
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_the_kernels_and_the_python_layer_agree(zoo, dtype, one_thread):
    """Decode, verify, tree and rollback passes: the same logits, bitwise, with each kernel; the
    Python layer (the reference, float rounding apart between the products) the same greedy tokens."""
    assert_kernels_and_python_agree(q4_target(zoo, dtype))


@NO_COMPILER
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("shape", SHAPES, ids=("most tokens", "most tree nodes"))
def test_speculative_answers_are_the_plain_answers(zoo, one_thread, dtype, shape):
    """On Q4_0 weights, speculative greedy is plain greedy token for token, chains and trees up to
    the most the settings allow, with drafts rejected part-way."""
    assert_speculative_is_plain(q4_target(zoo, dtype), shape)


@NO_COMPILER
def test_a_slower_kernel_is_named_on_the_log(zoo, caplog):
    native = fast_native.layer()
    in_use = native.int8_kernel()
    target = copy.copy(zoo.target("qwen2_vl"))
    try:
        native.use_int8_kernel("portable")
        target.runner = runner_for(copy.deepcopy(target.model), target.family)
        with caplog.at_level(logging.WARNING, logger="engine.target"):
            quantize_fast(target.runner, "tiny", "q4_0")
    finally:
        native.use_int8_kernel(in_use)
    assert "--quantization q4_0: " in caplog.text and "portable integer loop" in caplog.text
