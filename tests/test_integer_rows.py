"""Integer rows on the weights' own GGUF blocks (`--weight-arithmetic integer`): x made int8 per block
of 32, exact integer sums per block, one float epilogue per block (engine/fast_blocks.h; the
reference, engine/packed.py `integer_product`). Every kernel is the reference bit for bit, for
Q4_0, Q4_1 and Q8_0 blocks of gguf-py's own quantizer, any number of rows up to the most a verify
pass has; a whole model on the tiny SmolLM2-shaped GGUF verifies bitwise its decode passes and
answers speculative greedy as plain greedy; anything but blocks is refused when it is loaded."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine import fast_native, packed
from engine.fast_decode import PRODUCTS
from engine.target import load_target, use_weight_arithmetic
from models.loading import LoadError, LoadOptions
from tests.test_fast_native import MOST_ROWS, NO_COMPILER, assert_verify_is_decode, passes
from tests.test_smol_demo import tiny  # noqa: F401 (a fixture: the tiny SmolLM2 GGUF, assembled)
from tests.test_w8a8 import SHAPES, assert_speculative_is_plain

QTYPES = {"q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}
ROWS = (1, 2, 3, 4, 5, 8, 9, 17, MOST_ROWS)


def gguf_blocks(out: int, width: int, format: str, seed: int) -> torch.Tensor:
    """(out, width / 32, bytes) uint8: gguf-py's blocks of a random weight, with an all-zero block."""
    weight = torch.randn(out, width, generator=torch.Generator().manual_seed(seed)) * 0.05
    weight[0, :32] = 0.0
    blocks = quants.quantize(weight.numpy(), QTYPES[format])
    return torch.from_numpy(np.ascontiguousarray(blocks)).reshape(out, width // 32, packed.FORMATS[format])


def awkward_rows(n: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """x (n, width) float32 with what the rounding meets: a block of zeros, an outlier, halfway cases."""
    x = torch.randn(n, width, generator=generator)
    x[0, :32] = 0.0
    x[n // 2, width // 2 + 1] = 20.0
    x[-1, -32:] = torch.arange(32) % 9 - 3.5  # top 4.5 would make them 127 / 4.5 ths: halfway below ...
    x[-1, -32] = 127.0  # ... so top 127: inverse 1, x * 1 = k + 0.5, rounded to even
    return x


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@NO_COMPILER
@pytest.mark.parametrize("format", ("q4_0", "q4_1", "q8_0"))
@pytest.mark.parametrize("out, width", [(37, 96), (24, 160), (9, 32)])
def test_every_kernel_is_the_reference_bit_for_bit(format, out, width):
    """Each kernel (forced by name) against engine/packed.py's integer_product, for 1 row to the most
    a verify pass has, on two threads; each row as its own one-row product; within 3 % of the float32
    product over the blocks' values but in the row of halfway cases (so the reference is the product it
    claims to be)."""
    native = fast_native.layer()
    blocks = gguf_blocks(out, width, format, seed=width)
    values = torch.from_numpy(quants.dequantize(blocks.numpy().reshape(out, -1), QTYPES[format]))  # (out, width)
    bias = torch.randn(out)
    generator = torch.Generator().manual_seed(out)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for n in ROWS:
            x = awkward_rows(n, width, generator)
            reference = packed.integer_product(x, blocks, format)
            for kernel in native.integer_rows_kernels_built():
                y = native.integer_rows_product(x, blocks, None, kernel)
                assert torch.equal(bits(y), bits(reference)), (kernel, n)
                one_by_one = torch.cat([native.integer_rows_product(row[None], blocks, None, kernel) for row in x])
                assert torch.equal(bits(one_by_one), bits(y)), (kernel, n)
                with_bias = native.integer_rows_product(x, blocks, bias, kernel)
                assert torch.equal(bits(with_bias), bits(reference + bias)), (kernel, n)
            exact = x[:-1].double() @ values.double().t()  # the last row's int8 step is 1 for values of ~4
            assert (reference[:-1].double() - exact).norm() <= 0.03 * exact.norm()
    finally:
        torch.set_num_threads(threads)


@NO_COMPILER
def test_this_cpus_vector_kernel_is_built():
    """AVX2 here (the portable loops everywhere): a test above that compared only the portable kernel
    with itself would prove little."""
    built = fast_native.layer().integer_rows_kernels_built()
    assert built[-1] == "portable"
    if "avx2" in open("/proc/cpuinfo").read().split():
        assert "avx2" in built


def test_the_reference_states_its_arithmetic():
    """A worked Q8_0 block: x = (2, 0, ..., 0, -1): top 2, d_x = 2 / 127, values 127 and round(-63.5) =
    -64 (halves to even); weight codes (3, ..., 3, 5) with d = 0.5: sum 127 * 3 - 64 * 5 = 61, the output
    float(61) * (0.5 * (2 / 127))."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 31] = 2.0, -1.0
    block = torch.zeros(1, 1, 34, dtype=torch.uint8)
    block[0, 0, :2] = torch.tensor([0.5], dtype=torch.float16).view(torch.uint8)
    block[0, 0, 2:] = 3
    block[0, 0, 33] = 5
    values, scales, sums = packed.quantize_blocks(x)
    assert values[0, 0] == 127 and values[0, 31] == -64 and sums[0, 0] == 63
    d_x = torch.div(torch.tensor(2.0), torch.tensor(127.0))
    expected = torch.tensor(61.0) * (torch.tensor(0.5) * d_x)
    assert torch.equal(packed.integer_product(x, block, "q8_0")[0, 0], expected)


@NO_COMPILER
def test_integer_rows_on_anything_but_blocks_are_refused_at_load(zoo):
    native = fast_native.layer()
    with pytest.raises(RuntimeError, match="integer rows take a weight in ggml's blocks"):
        native.Weight(torch.randn(64, 32), integer_rows="")
    with pytest.raises(RuntimeError, match="no integer blocks kernel avx9"):
        native.Weight(gguf_blocks(8, 64, "q4_1", 0), integer_rows="avx9")
    target = copy.copy(zoo.target("qwen2_vl"))  # float32 weights that no blocks gave
    from engine.linear_attention_rollback import runner_for

    runner = runner_for(copy.deepcopy(target.model).float(), target.family)
    with pytest.raises(LoadError, match="no weight of 'tiny' is kept in GGUF blocks"):
        use_weight_arithmetic([runner], "tiny", LoadOptions(weight_arithmetic="integer"))
    with pytest.raises(LoadError, match="--quantization q4_0 replaces them"):
        use_weight_arithmetic([runner], "tiny", LoadOptions(weight_arithmetic="integer", quantization="q4_0"))


@pytest.fixture(scope="module")
def integer_target(tiny):  # noqa: F811
    """The tiny SmolLM2-shaped GGUF's assembled folder, loaded with integer rows."""
    if fast_native.layer() is None:
        pytest.skip(f"the compiled decode path is unavailable ({fast_native.unavailable()})")
    return load_target(str(tiny[1]), LoadOptions(dtype="float32", weight_arithmetic="integer"))


@NO_COMPILER
def test_the_demos_gguf_weights_multiply_int8_rows(integer_target):
    layers = integer_target.runner.fast.stack.layers
    weights = [getattr(layer, name) for layer in layers for name in PRODUCTS]
    assert all(isinstance(w, packed.PackedWeight) and w.arithmetic == "integer" for w in weights)
    pictures = integer_target.picture_runner  # picture weights, where the folder has them: the same blocks
    for layer in pictures.fast.stack.layers if pictures is not None else []:
        assert all(getattr(layer, name).base.arithmetic == "integer" for name in PRODUCTS)


@NO_COMPILER
@pytest.mark.parametrize("rows", (5, MOST_ROWS))
def test_a_verify_pass_is_bitwise_the_decode_passes(integer_target, rows):
    assert_verify_is_decode(integer_target.runner, integer_target, rows)


@NO_COMPILER
def test_whole_passes_are_alike_on_every_kernel(integer_target, one_thread):
    """Decode, verify, tree and rollback passes with each kernel chosen by name on the weights."""
    fast = integer_target.runner.fast
    logits = {}
    try:
        for kernel in fast.stack.native.integer_rows_kernels_built():
            fast.use_weight_arithmetic("integer", kernel)
            logits[kernel] = passes(integer_target.runner, integer_target)
    finally:
        fast.use_weight_arithmetic("integer")
    first, *others = logits.values()
    assert others and all(torch.equal(a, b) for other in others for a, b in zip(first, other))
    fast.use_weight_arithmetic("float")
    try:
        floats = passes(integer_target.runner, integer_target)
    finally:
        fast.use_weight_arithmetic("integer")
    assert not all(torch.equal(a, b) for a, b in zip(first, floats))  # another arithmetic: other bits


@NO_COMPILER
def test_the_python_layer_computes_the_same_products(integer_target, one_thread):
    """The Python layer (engine/fast_decode.linear: packed.integer_product) on the same blocks: its
    products are the kernels' bits, the rest of the layer sums in another order, so the passes agree
    to float rounding and on their greedy tokens."""
    stack = integer_target.runner.fast.stack
    compiled = passes(integer_target.runner, integer_target)
    native, stack.native = stack.native, None
    try:
        python = passes(integer_target.runner, integer_target)
    finally:
        stack.native = native
    for new, old in zip(python, compiled):
        torch.testing.assert_close(new, old, atol=5e-4, rtol=5e-4)
        assert torch.equal(new.argmax(-1), old.argmax(-1))


@NO_COMPILER
@pytest.mark.parametrize("shape", SHAPES, ids=("most tokens", "most tree nodes"))
def test_speculative_answers_are_the_plain_answers(integer_target, one_thread, shape):
    assert_speculative_is_plain(integer_target, shape)


def test_the_flag_wins_over_the_presets_arithmetic(monkeypatch):
    """Not given, --weight-arithmetic is the preset's (where no --quantization replaces the blocks),
    float with --model: the demo's default is one field of its preset (models/presets.py)."""
    import argparse
    from dataclasses import replace

    from engine.build import spec_from_args
    from engine.load_settings import add_model_flags
    from engine import fast_native  # the preset's integer rows only where the compiled CPU path runs
    from models import presets

    monkeypatch.setitem(presets.PRESETS, "smol", replace(presets.PRESETS["smol"], weight_arithmetic="integer"))
    monkeypatch.setattr(fast_native, "unavailable", lambda: None)
    parser = argparse.ArgumentParser()
    add_model_flags(parser)

    def arithmetic(*flags: str) -> str:
        return spec_from_args(parser.parse_args(["--device", "cpu", *flags])).options.weight_arithmetic

    assert arithmetic("--preset", "smol") == "integer"
    assert arithmetic("--preset", "smol", "--weight-arithmetic", "float") == "float"
    assert arithmetic("--preset", "smol", "--quantization", "int8") == "float"
    assert arithmetic("--preset", "demo") == "float"
    assert arithmetic("--model", "some/folder", "--weight-arithmetic", "integer") == "integer"
    assert arithmetic("--model", "some/folder") == "float"
    monkeypatch.setattr(fast_native, "unavailable", lambda: "turned off (VLM_NATIVE_LAYER=0)")
    assert arithmetic("--preset", "smol") == "float"
    assert arithmetic("--preset", "smol", "--weight-arithmetic", "integer") == "integer"  # given: refused at load
