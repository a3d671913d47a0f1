"""`--quantization w8a8`: int8 weights times int8 activations (engine/quantized.py, the reference;
engine/fast_int8.h, the compiled kernels). Integer sums are exact, so: the compiled product is
bitwise the Python reference's, with every kernel (AVX512-VNNI, portable), for any number of rows
and threads; a verify pass over up to the most rows the settings allow is bitwise its one-token
passes; speculative greedy answers are the plain ones (the logits against the unquantized model's:
tests/test_quantization.py); a slower kernel is named with its reason."""

from __future__ import annotations

import copy
import logging
from dataclasses import replace

import pytest
import torch

from engine import fast_native
from engine.engine import Engine
from engine.linear_attention_rollback import runner_for
from engine.loop import DecodeSettings
from engine.quantized import W8A8Weight, quantize_rows, quantized_linear
from engine.settings import spec
from engine.target import int8_activations_slow
from models import tiny
from tests.mocks import corrupt
from tests.test_fast_decode import prompt_of
from tests.test_fast_native import MOST_ROWS, NO_COMPILER, Oracle, assert_verify_is_decode

ROWS = (1, 5, 33, 64, MOST_ROWS)


@pytest.fixture
def int8_kernel(request):
    """The compiled module with the int8 kernel the test names in use."""
    native = fast_native.layer()
    assert native is not None, fast_native.unavailable()
    in_use = native.int8_kernel()
    if request.param not in native.int8_kernels_built() or \
            (request.param == "avx512-vnni" and native.int8_fallback_reason()):
        pytest.skip(f"no {request.param} int8 kernel here ({native.int8_fallback_reason()})")
    native.use_int8_kernel(request.param)
    yield native
    native.use_int8_kernel(in_use)


def w8a8_target(zoo, dtype, family="qwen2_vl"):
    """A copy of a tiny target in `dtype`, its fast path on W8A8 weights."""
    target = copy.copy(zoo.target(family))
    target.model = copy.deepcopy(target.model).to(dtype)
    target.runner = runner_for(target.model, target.family)
    target.runner.fast.quantize("w8a8")
    return target


def test_rows_are_quantized_each_on_its_own():
    x = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [300.0, 1.0, -2.0]])
    values, scales = quantize_rows(x)
    assert values.tolist() == [[64, -127, 32], [0, 0, 0], [127, 0, -1]]  # 63.5 -> 64, 31.75 -> 32
    assert torch.equal(scales, torch.tensor([1.0, 127.0, 300.0]) / 127)
    assert torch.equal(quantize_rows(x[2:])[0], values[2:])


@NO_COMPILER
@pytest.mark.parametrize("int8_kernel", ("avx512-vnni", "portable"), indirect=True)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("out, width", [(1031, 2048), (37, 100)], ids=("2048 wide", "tails"))
def test_the_compiled_product_is_the_reference_bitwise(int8_kernel, dtype, out, width):
    """A 2048-wide weight, and one whose width and outputs leave tails after the kernel's 64-byte
    steps and 4-output blocks: assert_product_rows."""
    generator = torch.Generator().manual_seed(out)
    weight = torch.randn(out, width, generator=generator).to(dtype).t()  # (in, out) view of (out, in)
    quantized = W8A8Weight.quantize(weight)
    bias = torch.randn(out, generator=generator).to(dtype)
    assert_product_rows(lambda x: int8_kernel.product(x, quantized.values.t(), bias, quantized.scales, quantized.sums),
                        lambda x: quantized_linear(x, quantized, bias),
                        lambda x: x.double() @ weight.double() + bias.double(), width, dtype, generator)


def assert_product_rows(multiply, reference, exact, width: int, dtype, generator) -> None:
    """For 1 to 65 rows x (n, width) of `dtype` on two threads, with an outlier in one row and halfway
    cases in the last: multiply(x) (the compiled product) is bitwise reference(x) (engine/quantized.py)
    and, row for row, its one-row products, and within 6 % of exact(x) (float64; the outlier row's
    int8 step is 20 / 127, about 0.16 of its typical value: ~4.5 % of its norm)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for n in ROWS:
            x = torch.randn(n, width, generator=generator).to(dtype)
            x[n // 2, 3] = 20.0
            x[-1] = torch.arange(width) % 9 - 3.5  # halfway cases: scale 1 (127 / 127), rounded to even
            x[-1, 0] = 127.0
            y = multiply(x)
            assert y.dtype == dtype and torch.equal(y, reference(x))
            assert torch.equal(y, torch.cat([multiply(row[None]) for row in x]))
            expected = exact(x)[:-1]
            assert (y[:-1].double() - expected).norm() <= 0.06 * expected.norm()
    finally:
        torch.set_num_threads(threads)


def each_kernel_and_size(test):
    """A verify test's parameters: both int8-activation kernels, every row count, float32 and bfloat16."""
    test = pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))(pytest.mark.parametrize("rows", ROWS)(test))
    return NO_COMPILER(pytest.mark.parametrize("int8_kernel", ("avx512-vnni", "portable"), indirect=True)(test))


@each_kernel_and_size
def test_a_verify_pass_is_bitwise_the_decode_passes(zoo, dtype, rows, int8_kernel):
    """As tests/test_fast_native.py's, for both int8 kernels."""
    assert_verify_is_decode((target := w8a8_target(zoo, dtype)).runner, target, rows)


@NO_COMPILER
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_the_kernels_and_the_python_layer_agree(zoo, dtype, one_thread):
    """Decode, verify, tree and rollback passes: the same logits, bitwise, with each int8 kernel;
    the Python layer (the reference, float rounding apart between the products) the same greedy
    tokens."""
    assert_kernels_and_python_agree(w8a8_target(zoo, dtype))


def assert_kernels_and_python_agree(target) -> None:
    """The compiled passes of `target` bitwise alike with every int8-activation kernel this CPU runs,
    and the Python layer's greedy tokens theirs (all but one pass at most)."""
    from tests.test_fast_native import passes

    native = fast_native.layer()
    in_use, logits = native.int8_kernel(), {}
    try:
        for name in native.int8_kernels_built():
            if name != "avx512-vnni" or not native.int8_fallback_reason():
                native.use_int8_kernel(name)
                logits[name] = passes(target.runner, target)
    finally:
        native.use_int8_kernel(in_use)
    first, *others = logits.values()
    assert all(torch.equal(a, b) for other in others for a, b in zip(first, other))
    target.runner.fast.stack.native = None
    python = passes(target.runner, target)
    assert sum(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(first, python)) >= len(python) - 1


SHAPES = [dict(draft_tokens=spec("draft_tokens").high),
          dict(draft_tokens=24, draft_tree=spec("draft_tree").high, tree_branching=3)]  # the most the settings allow


@NO_COMPILER
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("shape", SHAPES, ids=("most tokens", "most tree nodes"))
def test_speculative_answers_are_the_plain_answers(zoo, one_thread, dtype, shape):
    """On W8A8 weights, speculative greedy is plain greedy token for token, chains and trees up to
    the most the settings allow, with drafts rejected part-way."""
    assert_speculative_is_plain(w8a8_target(zoo, dtype), shape)


def assert_speculative_is_plain(target, shape: dict) -> None:
    """A two-image turn: an oracle drafter's corrupted drafts (rejected part-way) of `shape` give
    the plain greedy answer, token for token."""
    messages = [{"role": "user", "content": [{"type": "image", "image": image} for image in tiny.tiny_images(2, seed=5)]
                 + [{"type": "text", "text": "Describe both."}]}]
    decode = DecodeSettings(max_new_tokens=120, stop_token_ids=frozenset({-1}), **shape)
    plain = list(Engine(target).stream(messages, decode=replace(decode, draft_tokens=None, draft_tree=0)))[-1]
    speculative = list(Engine(target, {"oracle": Oracle(corrupt(plain.token_ids), target.vocab_size)}).stream(
        messages, drafter="oracle", decode=decode))[-1]
    assert speculative.token_ids == plain.token_ids
    assert speculative.stats.fallback_reason is None and speculative.stats.accepted > 0


@NO_COMPILER
def test_a_slower_int8_kernel_is_named_with_its_reason(caplog):
    native = fast_native.layer()
    in_use = native.int8_kernel()
    assert int8_activations_slow(native) is None or native.int8_fallback_reason()
    try:
        native.use_int8_kernel("portable")
        assert "portable integer loop" in int8_activations_slow(native)
    finally:
        native.use_int8_kernel(in_use)
    assert "Python reference" in int8_activations_slow(None)
    with pytest.raises(RuntimeError, match="no int8 kernel avx2"):
        native.use_int8_kernel("avx2")
