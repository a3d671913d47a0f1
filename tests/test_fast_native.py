"""The compiled stack (engine/fast_native.py, engine/fast_layer.cpp) against the Python layer
(engine/fast_decode.decoder_layer, its reference) on the same weights, in both layouts: float32
logits within float rounding and the same greedy tokens, bfloat16 logits equal to bfloat16
precision, for decode, verify, draft-tree and rollback passes, on one thread and with attention
split across threads over a long context (the drafter heads' passes are checked against their
modules in tests/test_own_drafters.py); verify passes bitwise their decode passes up to the most
rows the settings allow; what the compiled stack does not take refused; a clear fallback to the
Python layer where it cannot be built."""

from __future__ import annotations

import copy
import os
import shutil
from dataclasses import replace

import pytest
import torch

from engine import fast_native
from engine.drafters.base import Draft
from engine.fast_decode import FastDecoder
from engine.quantized import Int8Weight, W8A8Weight, quantize_rows
from engine.engine import Engine
from engine.loop import DecodeSettings
from engine.tree import MAX_VERIFY_ROWS, chain_parents
from engine.runner import NO_READS, Runner, TargetReads
from engine.settings import spec
from models import tiny
from tests.mocks import corrupt
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


def compiled_and_python(target, input_major: bool = False) -> tuple[list, list]:
    """The passes' logits with the compiled stack, then with the Python layer, on the same weights
    in one layout: (out, in), the compiled stack's own, or input-major, the Python layer's where
    nothing is compiled (the compiled stack then runs ATen's products on it)."""
    target = copy.copy(target)
    target.model = copy.deepcopy(target.model)  # its Linear weights become views of this layout's buffers
    runner = Runner(target.model, target.family)
    runner.fast = FastDecoder(target.model, input_major=input_major)
    assert runner.fast.stack.native is not None, fast_native.unavailable()
    compiled = passes(runner, target)
    runner.fast.stack.native = None  # the Python layer, same weights
    return compiled, passes(runner, target)


FLOAT32 = 5e-5  # float rounding of sums in another order, a few layers deep
NO_COMPILER = pytest.mark.skipif(shutil.which("c++") is None or os.environ.get("VLM_NATIVE_LAYER") == "0",
                                 reason="no C++ compiler on this machine, or VLM_NATIVE_LAYER=0")


def assert_same_answers(compiled: list[torch.Tensor], python: list[torch.Tensor], tolerance: float) -> None:
    for new, old in zip(compiled, python):
        torch.testing.assert_close(new, old, atol=tolerance, rtol=tolerance)
        assert torch.equal(new.argmax(-1), old.argmax(-1))


@NO_COMPILER
@pytest.mark.parametrize("input_major", (False, True), ids=("out-in", "input-major"))
@pytest.mark.parametrize("family", ("qwen2_vl", "idefics3"))
def test_compiled_stack_is_the_python_layers_arithmetic(zoo, family, input_major, one_thread):
    """engine/fast_layer.cpp against its reference, fast_decode.decoder_layer, on both layouts."""
    compiled, python = compiled_and_python(zoo.target(family), input_major)
    assert_same_answers(compiled, python, FLOAT32)
    assert not all(torch.equal(new, old) for new, old in zip(compiled, python))  # its own loops, not ATen's


@NO_COMPILER
@pytest.mark.parametrize("input_major", (False, True), ids=("out-in", "input-major"))
def test_compiled_stack_in_bfloat16(zoo, input_major, one_thread):
    """16-bit weights: float32 attention over a float32 cache, on both layouts."""
    target = bitwise_target(zoo, torch.bfloat16)
    compiled, python = compiled_and_python(target, input_major)
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


@NO_COMPILER
def test_attention_and_silu_in_lanes_give_the_loops_answers(zoo):
    """Where the build has AVX-512, attention rows and SiLU's exp run in 16 lanes (their own sums and
    exp, so other bits than the plain loops'): decode, verify, tree and rollback passes give the
    loops' answers within float rounding over a long context, and with either a verify pass is
    bitwise its decode passes."""
    native = fast_native.layer()
    target = bitwise_target(zoo, torch.float32)
    runner = Runner(target.model, target.family)
    long_text = torch.randint(16, 200, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    results = []
    try:
        for lanes in (True, False):
            native.use_lanes_math(lanes)
            logits, state = runner.prefill(prompt_of(target, 2).target_inputs)
            results.append([runner.extend(state, long_text), *passes(runner, target)])
            assert_verify_is_decode(runner, target, 9)
    finally:
        native.use_lanes_math(True)
    assert_same_answers(*results, FLOAT32)
    if "avx512" in native.rows_kernels_built():
        assert not all(torch.equal(a, b) for a, b in zip(*results))  # the lanes ran


def bitwise_target(zoo, dtype):
    target = copy.copy(zoo.target("qwen2_vl"))
    target.model = copy.deepcopy(target.model).to(dtype)
    return target


@pytest.fixture
def rows_kernel(request):
    """The compiled module with the rows kernel the test names in use ("native": this CPU's own)."""
    native = fast_native.layer()
    assert native is not None, fast_native.unavailable()
    in_use = native.rows_kernel()
    if request.param not in ("native", *native.rows_kernels_built()):
        pytest.skip(f"no {request.param} kernel for this CPU (built: {', '.join(native.rows_kernels_built())})")
    native.use_rows_kernel(in_use if request.param == "native" else request.param)
    yield native
    native.use_rows_kernel(in_use)


# The most rows a verify pass has under the schema's ranges: the last committed token and a
# chain of draft_tokens, or a tree of draft_tree nodes.
MOST_ROWS = 1 + max(spec("draft_tokens").high, spec("draft_tree").high)


@NO_COMPILER
def test_the_rows_kernel_takes_every_verify_pass_the_settings_allow():
    """One constant: the build's rows kernel stops at engine/tree.py's MAX_VERIFY_ROWS, which the
    settings' ranges are made from."""
    assert fast_native.layer().rows_kernel_max == MAX_VERIFY_ROWS == MOST_ROWS


@NO_COMPILER
@pytest.mark.parametrize("rows_kernel", ("native", "avx2", "portable"), indirect=True)
@pytest.mark.parametrize("rows", (5, 33, 64, MOST_ROWS))
@pytest.mark.parametrize("dtype, int8", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_a_verify_pass_is_bitwise_the_decode_passes(zoo, dtype, int8, rows, rows_kernel):
    """Each row is summed alone, whatever the rows beside it and the threads: a pass over `rows`
    tokens (up to the most a verify pass has under the settings' ranges) on two threads gives, row
    for row, the logits of that many one-token passes on one thread, and leaves the same cache, in
    bfloat16 and int8 too (where batched kernels round differently:
    ../shared/notes/transformers-facts.md); with this CPU's kernel and the narrower ones."""
    target = bitwise_target(zoo, dtype)
    runner = Runner(target.model, target.family)
    if int8:
        runner.fast.quantize()
    assert_verify_is_decode(runner, target, rows)


def assert_verify_is_decode(runner, target, rows: int) -> None:
    """A pass over `rows` tokens on two threads gives, row for row, the logits of that many one-token
    passes on one thread, and leaves the same cache."""
    threads = torch.get_num_threads()
    try:
        logits, state = runner.prefill(prompt_of(target, 1).target_inputs)
        generator = torch.Generator().manual_seed(rows)
        tokens = [int(logits.argmax())] + torch.randint(16, 200, (rows - 1,), generator=generator).tolist()
        torch.set_num_threads(2)
        batched = runner.extend(state, tokens)
        cache = [keys[0, :, :state.cache_len].clone() for keys in state.cache.keys]
        runner.rollback(state, len(tokens))
        torch.set_num_threads(1)
        one_by_one = torch.cat([runner.extend(state, [token]) for token in tokens])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batched, one_by_one)
    assert all(torch.equal(before, keys[0, :, :state.cache_len]) for before, keys in zip(cache, state.cache.keys))



@NO_COMPILER
@pytest.mark.parametrize("lanes", (True, False))
@pytest.mark.parametrize("dtype, int8", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_a_tree_row_is_bitwise_its_paths_decode_row(zoo, dtype, int8, lanes):
    """A draft tree whose path comes after a 20-node decoy branch: the path's entries sit 20 cache
    slots further on than plain decoding puts them, among the decoy's hidden slots. Each path row's
    logits are bitwise the decode pass of that path's token, so attention's sums must not depend on
    a key's cache slot (the AVX-512 lanes once added each weight into lane slot % 16); with the
    lanes and with the loops."""
    native = fast_native.layer()
    target = bitwise_target(zoo, dtype)
    runner = Runner(target.model, target.family)
    if int8:
        runner.fast.quantize()
    prompt = prompt_of(target, 1).target_inputs
    generator = torch.Generator().manual_seed(20)
    decoy, path = (torch.randint(16, 200, (count,), generator=generator).tolist() for count in (20, 4))
    try:
        native.use_lanes_math(lanes)
        logits, state = runner.prefill(prompt)
        root = int(logits.argmax())
        parents = [-1, *range(0, 20), 0, 21, 22, 23]  # root; the decoy root-d1-...-d20; the path root-p1-...-p4
        tree = runner.extend_tree(state, [root, *decoy, *path], parents)
        path_rows = tree[[0, 21, 22, 23, 24]]
        _, state = runner.prefill(prompt)
        decode_rows = torch.cat([runner.extend(state, [token]) for token in (root, *path)])
    finally:
        native.use_lanes_math(True)
    assert torch.equal(path_rows, decode_rows)

@NO_COMPILER
@pytest.mark.parametrize("dtype, int8", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_passes_that_keep_hidden_rows_for_a_drafter_give_the_plain_logits(zoo, dtype, int8, one_thread):
    """A drafter that reads the target's hidden states (here the embeddings, layer 1 and the final
    norm's rows) leaves the logits alone: the verify and decode passes of such a request give
    bitwise the logits of passes that keep nothing (plain decoding's), through the same compiled
    output layer (it once took torch.mm there, another kernel, at half the speed)."""
    target = bitwise_target(zoo, dtype)
    runner = Runner(target.model, target.family)
    if int8:
        runner.fast.quantize()
    prompt = prompt_of(target, 1)
    logits = {}
    for reads in (NO_READS, TargetReads(hidden_layers=(0, 1, -1))):
        first, state = runner.prefill(prompt.target_inputs, reads)
        tokens = [int(first.argmax())] + torch.randint(16, 200, (4,), generator=torch.Generator().manual_seed(0)).tolist()
        verify = runner.extend(state, tokens)
        assert bool(reads.hidden_layers) == bool(state.hidden) and all(len(state.hidden[i]) == 5 for i in reads.hidden_layers)
        logits[reads] = torch.cat([verify, runner.extend(state, [int(verify[-1].argmax())])])
    assert torch.equal(*logits.values())


@NO_COMPILER
@pytest.mark.parametrize("rows_kernel", ("avx512", "avx2", "portable"), indirect=True)
@pytest.mark.parametrize("dtype, int8", [(torch.float32, False), (torch.bfloat16, False), (torch.float16, False),
                                         (torch.float32, True), (torch.bfloat16, True)])
def test_the_rows_kernel_sums_each_row_alone(rows_kernel, dtype, int8):
    """The compiled product at a real model's width (2048 in, 1031 out: tail columns after every
    kernel's blocks, a bias; the weight in `dtype` or as int8 values with per-output scales), 1 to 9
    rows on two threads, with each kernel (AVX-512, AVX2, and the portable one other CPUs run): each
    row bitwise its one-row product, all within the dtype's rounding of a float64 product."""
    native = rows_kernel
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(1031, 2048, generator=generator).to(dtype).t()  # (in, out) view of (out, in)
    scales = None
    if int8:
        quantized = Int8Weight.quantize(weight)
        weight, scales = quantized.values.t(), quantized.scales
        exact_weight = quantized.values.double() * quantized.scales.double()[:, None]
    else:
        exact_weight = weight.double().t()
    bias = torch.randn(1031, generator=generator).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for n in (1, 2, 3, 4, 5, 9):
            x = torch.randn(n, 2048, generator=generator).to(dtype)
            y = native.product(x, weight, bias, scales)
            one_by_one = torch.cat([native.product(row[None], weight, bias, scales) for row in x])
            assert y.dtype == dtype and torch.equal(y, one_by_one)
            exact = x.double() @ exact_weight.t() + bias.double()
            torch.testing.assert_close(y.double(), exact, rtol=1e-2 if dtype != torch.float32 else 1e-5,
                                       atol=0.5 if dtype != torch.float32 else 1e-3)
    finally:
        torch.set_num_threads(threads)


@NO_COMPILER
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_every_rows_kernel_gives_the_same_bits(zoo, dtype):
    """CPUs without AVX-512 run the AVX2 or the portable rows kernel: the same fused multiply-adds
    in the same order, so every pass's logits (decode, verify, a draft tree, after a rollback) are
    bitwise the same with each kernel this machine can run: an answer does not depend on the CPU's
    vector width."""
    native = fast_native.layer()
    assert native is not None, fast_native.unavailable()
    built = native.rows_kernels_built()
    assert built[-1] == "portable" and native.rows_kernel() == built[0]
    target = bitwise_target(zoo, dtype)
    runner = Runner(target.model, target.family)
    logits = {}
    try:
        for name in built:
            native.use_rows_kernel(name)
            logits[name] = passes(runner, target)
    finally:
        native.use_rows_kernel(built[0])
    for name in built[1:]:
        assert all(torch.equal(a, b) for a, b in zip(logits[built[0]], logits[name])), name


class Oracle:
    """Drafts a fixed continuation, k tokens a round (a deterministic drafter); as a tree, that
    continuation is the first branch, with leaves beside and below it up to the node budget (the
    leaf beside a corrupted token (`corrupt`: the id below) is the true one: a path through a
    second child). Every id it proposes is below `vocab_size` (a tiny model's last ids do come up)."""

    name, kind, reads = "oracle", "test", TargetReads()

    def __init__(self, continuation: list[int], vocab_size: int):
        self.continuation, self.vocab_size = continuation, vocab_size

    def begin(self, prompt, target_state):
        return self

    def propose(self, generated, k, sampler):
        return Draft(self.continuation[len(generated):len(generated) + k])

    def propose_tree(self, generated, depth, budget, branching, sampler):
        chain = self.continuation[len(generated):len(generated) + depth]
        token_ids, parents = list(chain), chain_parents(len(chain))
        beside = [((token + 1) % self.vocab_size, parents[node]) for node, token in enumerate(chain)]
        below = [((token + 7) % self.vocab_size, node) for node, token in enumerate(chain)]
        for token, parent in (beside + below)[:max(0, budget - len(chain))]:
            token_ids.append(token)
            parents.append(parent)
        return Draft(token_ids, None, parents)

    def tree_unsupported(self):
        return None

    def accept(self, num_accepted, path=None):
        pass


@NO_COMPILER
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("shape", [dict(draft_tokens=4), dict(draft_tokens=spec("draft_tokens").high),
                                   dict(draft_tokens=24, draft_tree=spec("draft_tree").high, tree_branching=3)],
                         ids=("4 tokens", "most tokens", "most tree nodes"))
def test_speculative_answers_are_the_plain_answers(zoo, one_thread, dtype, shape):
    """With verify passes bitwise the decode passes, a bfloat16 target's speculative greedy
    answer is its plain one, token for token, in float32 and bfloat16, for chains up to the most
    draft tokens and trees up to the most nodes the settings allow, with some drafts rejected
    part-way (the drafter proposes a corrupted copy of the answer)."""
    target = bitwise_target(zoo, dtype)
    messages = [{"role": "user", "content": [{"type": "image", "image": image} for image in tiny.tiny_images(2, seed=5)]
                 + [{"type": "text", "text": "Describe both."}]}]
    decode = DecodeSettings(max_new_tokens=160, stop_token_ids=frozenset({-1}), **shape)
    plain = list(Engine(target).stream(messages, decode=replace(decode, draft_tokens=None, draft_tree=0)))[-1]
    proposed = corrupt(plain.token_ids)
    engine = Engine(target, {"oracle": Oracle(proposed, target.vocab_size)})
    speculative = list(engine.stream(messages, drafter="oracle", decode=decode))[-1]
    assert speculative.token_ids == plain.token_ids
    assert speculative.stats.fallback_reason is None and speculative.stats.tree_fallback is None
    assert max(speculative.stats.draft_lengths) == shape.get("draft_tree", shape["draft_tokens"])  # nodes a pass
    assert speculative.stats.accepted > 0


def test_turned_off_or_unbuildable_the_python_layer_runs_and_says_why(zoo, monkeypatch, one_thread):
    """VLM_NATIVE_LAYER=0: nothing is built (not even to pick the weights' layout), and the Python
    layer runs on its own, input-major layout; where the build fails, the same, with the reason."""
    target = copy.copy(zoo.target("qwen2_vl"))
    target.model = copy.deepcopy(target.model)

    def broken(**_):
        raise RuntimeError("Error building extension 'vlm_fast_layer'\nfast_layer.cpp:1: error: no compiler")

    monkeypatch.setattr("torch.utils.cpp_extension.load", broken)
    monkeypatch.setattr(fast_native, "_build", fast_native._build.__wrapped__)  # no cached result
    monkeypatch.setenv("VLM_NATIVE_LAYER", "0")
    assert fast_native.layer() is None and "VLM_NATIVE_LAYER=0" in fast_native.unavailable()
    fast = Runner(target.model, target.family).fast
    assert fast.stack.native is None and fast.input_major
    assert fast.stack.layers[0].qkv_weight.is_contiguous()  # (in, out) itself, not a transposed view

    monkeypatch.setenv("VLM_NATIVE_LAYER", "1")
    assert fast_native.layer() is None
    assert "could not be built" in fast_native.unavailable() and "no compiler" in fast_native.unavailable()
    runner = Runner(target.model, target.family)
    assert runner.fast.stack.native is None
    logits, state = runner.prefill(prompt_of(target, 1).target_inputs)
    assert runner.extend(state, [int(logits.argmax())]).isfinite().all()


@NO_COMPILER
def test_the_compiled_stack_refuses_what_it_does_not_take(zoo, one_thread):
    """The compiled stack takes a float32 cache (what FastStack makes on a CPU; elsewhere the
    Python layer runs): a cache in the weights' bfloat16 is refused by name, not computed."""
    target = bitwise_target(zoo, torch.bfloat16)
    stack = Runner(target.model, target.family).fast.stack
    assert stack.native is not None and stack.cache_dtype == torch.float32
    stack.cache_dtype = torch.bfloat16
    cache = stack.new_cache(8)
    x = torch.zeros(1, target.model.config.get_text_config().hidden_size, dtype=torch.bfloat16)
    cos, signed_sin = stack.rotary(range(0, 1))
    with pytest.raises(RuntimeError, match="float32 cache"):
        stack.native.stack(x, stack._native_layers(), cos, signed_sin, cache.keys, cache.values, 0, None,
                           *stack.sizes_args, [])


@NO_COMPILER
def test_greedy_tokens_are_atens_argmax_first_of_equals():
    """The compiled argmax (engine/sampling.py greedy_tokens) gives torch.argmax's index on every
    row: ties (the first wins), -inf rows and a draft vocabulary's -inf holes, widths around the
    16 lanes."""
    from engine.sampling import greedy_tokens

    generator = torch.Generator().manual_seed(0)
    for width in (1, 7, 16, 17, 33, 49152):
        logits = torch.randn(5, width, generator=generator)
        logits[1] = logits[1].round()  # many equal values
        logits[2] = float("-inf")
        logits[3, torch.randperm(width, generator=generator)[: width // 2]] = float("-inf")
        logits[4, :] = 1.0
        logits[4, width // 2:] = 2.0  # the first 2.0 wins
        assert greedy_tokens(logits) == logits.argmax(-1).tolist(), width
