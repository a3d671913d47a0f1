"""The compiled stack (engine/fast_native.py, engine/fast_layer.cpp) against the Python layer
(engine/fast_decode.decoder_layer) on the same weights: float32 logits within float rounding and
the same greedy tokens, bfloat16 logits equal to bfloat16 precision, for decode, verify, draft-tree
and rollback passes, on one thread and with attention split across threads over a long context
(the drafter heads' passes are checked against their modules in tests/test_own_drafters.py);
the ATen branch for other type pairs bitwise; a clear fallback to the Python layer where it
cannot be built."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from engine import fast_native
from engine.runner import Runner
from tests.test_fast_decode import prompt_of


def passes(runner, target) -> list[torch.Tensor]:
    """Logits of a fixed run of passes over a one-image prompt: decode, verify, a draft tree and
    its keep_path, rollback, decode again."""
    logits, state = runner.prefill(prompt_of(target, 1).target_inputs)
    token = int(logits.argmax())
    out = [runner.extend(state, [token]), runner.extend(state, [7, 9, 11, 5])]
    runner.rollback(state, 3)
    out.append(runner.extend_tree(state, [token, 7, 9, 11], [-1, 0, 0, 1]))
    runner.keep_path(state, [0, 2])
    out.append(runner.extend(state, [5]))
    return out


def compiled_and_python(target) -> tuple[list, list]:
    runner = Runner(target.model, target.family)
    assert runner.fast.stack.native is not None, fast_native.unavailable()
    compiled = passes(runner, target)
    runner.fast.stack.native = None  # the Python layer, same weights
    return compiled, passes(runner, target)


FLOAT32 = 5e-5  # float rounding of sums in another order, a few layers deep
NO_COMPILER = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on this machine")


def assert_same_answers(compiled: list[torch.Tensor], python: list[torch.Tensor], tolerance: float) -> None:
    for new, old in zip(compiled, python):
        torch.testing.assert_close(new, old, atol=tolerance, rtol=tolerance)
        assert torch.equal(new.argmax(-1), old.argmax(-1))


@NO_COMPILER
@pytest.mark.parametrize("family", ("qwen2_vl", "idefics3"))
def test_compiled_stack_is_the_python_layers_arithmetic(zoo, family, one_thread):
    compiled, python = compiled_and_python(zoo.target(family))
    assert_same_answers(compiled, python, FLOAT32)
    assert not all(torch.equal(new, old) for new, old in zip(compiled, python))  # its own loops, not ATen's


@NO_COMPILER
def test_compiled_stack_in_bfloat16(zoo, one_thread):
    """16-bit weights: input-major products and float32 attention over a float32 cache."""
    target = copy.copy(zoo.target("qwen2_vl"))
    target.model = copy.deepcopy(target.model).to(torch.bfloat16)
    compiled, python = compiled_and_python(target)
    assert Runner(target.model, target.family).fast.stack.cache_dtype == torch.float32
    assert_same_answers(compiled, python, 2 ** -7)  # bfloat16's precision


@NO_COMPILER
def test_attention_split_across_threads_over_a_long_context(zoo):
    """A pass of 300 tokens after a two-image prompt, then decode and verify passes over that
    context: the compiled attention runs its heads and rows on two threads (engine/fast_layer.cpp
    splits when a thread gets enough work), and still gives the Python layer's answers."""
    target = zoo.target("qwen2_vl")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runner = Runner(target.model, target.family)
        inputs = prompt_of(target, 2).target_inputs
        long_text = torch.randint(16, 200, (300,), generator=torch.Generator().manual_seed(0)).tolist()
        results = []
        for native in (runner.fast.stack.native, None):
            runner.fast.stack.native = native
            logits, state = runner.prefill(inputs)
            results.append([runner.extend(state, long_text), runner.extend(state, [int(logits.argmax())]),
                            runner.extend(state, [7, 9, 11, 5])])
        assert_same_answers(*results, FLOAT32)
    finally:
        torch.set_num_threads(threads)


def test_turned_off_or_unbuildable_the_python_layer_runs_and_says_why(zoo, monkeypatch, one_thread):
    target = zoo.target("qwen2_vl")
    monkeypatch.setattr(fast_native, "_build", fast_native._build.__wrapped__)  # no cached result
    monkeypatch.setenv("VLM_NATIVE_LAYER", "0")
    assert fast_native.layer() is None and "VLM_NATIVE_LAYER=0" in fast_native.unavailable()
    assert Runner(target.model, target.family).fast.stack.native is None

    def broken(**_):
        raise RuntimeError("Error building extension 'vlm_fast_layer'\nfast_layer.cpp:1: error: no compiler")

    monkeypatch.setenv("VLM_NATIVE_LAYER", "1")
    monkeypatch.setattr("torch.utils.cpp_extension.load", broken)
    assert fast_native.layer() is None
    assert "could not be built" in fast_native.unavailable() and "no compiler" in fast_native.unavailable()
    runner = Runner(target.model, target.family)
    assert runner.fast.stack.native is None
    logits, state = runner.prefill(prompt_of(target, 1).target_inputs)
    assert runner.extend(state, [int(logits.argmax())]).isfinite().all()


@NO_COMPILER
def test_a_cache_in_the_weights_dtype_takes_the_layers_aten_branch_bitwise(zoo, one_thread):
    """bfloat16 activations over a bfloat16 cache (no loops for that pair: the layer's ATen calls,
    bitwise the Python layer's)."""
    target = copy.copy(zoo.target("qwen2_vl"))
    target.model = copy.deepcopy(target.model).to(torch.bfloat16)
    runner = Runner(target.model, target.family)
    runner.fast.stack.cache_dtype = torch.bfloat16
    compiled = passes(runner, target)
    runner.fast.stack.native = None
    python = passes(runner, target)
    assert all(torch.equal(new, old) for new, old in zip(compiled, python))
