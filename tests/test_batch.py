"""Several requests' passes in one target pass (engine/runner.py `Runner.run`, engine/fast_layer.cpp
`stack_parts`): the products over all their rows, the attention per request over its own cache.
Each request's logits are bitwise those of its own pass (torch.equal), with any mix of neighbours
(a plain step, chains, trees, prompts with 0-2 images), and so are the hidden rows a drafter reads
and the caches they leave: on the compiled stack in float32 and bfloat16, with int8 and w8a8
weights and over GGUF blocks (float and integer rows), and on the Python paths, which run each
request's pass alone."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.runner import NO_READS, Runner, TargetReads
from engine.tree import MAX_VERIFY_ROWS, Pass
from tests.test_fast_decode import prompt_of
from tests.test_fast_native import NO_COMPILER, bitwise_target

# Each request's passes, round after round: (tokens after the last committed one, tree parents or
# None for a chain, what the round keeps: the entries of a tree's path, or a chain's first n).
TREE = [-1, 0, 0, 1, -1, 4]  # root; a - b - c, a - x; y - z (tree.py's convention, as entries after the root)
REQUESTS = [  # (images in the prompt, rounds)
    (0, [([], None, 1), ([], None, 1)]),  # plain: one row a round
    (1, [([7, 9, 11, 5], None, 3), ([13, 17], None, 1)]),  # chains
    (2, [([7, 9, 11, 5, 3, 2], TREE, [0, 1, 2, 4]), ([9], None, 2)]),  # a tree, then a chain
    (0, [([5] * 60, None, 31), ([8, 6], [-1, 0], [0, 1, 2])]),  # 61 rows: the first round runs as two passes
]
READS = {2: TargetReads(hidden_layers=(0, 1, -1))}  # a request whose drafter reads the target's hidden rows


def requests(runner, target) -> list:
    """Each request's state after its prompt, and its first token."""
    states = []
    for index, (num_images, _) in enumerate(REQUESTS):
        logits, state = runner.prefill(prompt_of(target, num_images).target_inputs, READS.get(index, NO_READS))
        states.append((state, int(logits.argmax())))
    return states


def round_passes(states, round_index: int) -> list[Pass]:
    passes = []
    for (state, last), (_, rounds) in zip(states, REQUESTS):
        tokens, parents, _ = rounds[round_index]
        passes.append(Pass(state, [last, *tokens], None if parents is None else [-1] + [p + 1 for p in parents]))
    return passes


def settle(runner, states, passes, round_index: int) -> list:
    """Keep each request's path (a tree's) or its chain's first tokens; the next committed token."""
    settled = []
    for (state, _), one, (_, rounds) in zip(states, passes, REQUESTS):
        kept = rounds[round_index][2]
        if one.parents is None:
            runner.rollback(state, len(one.token_ids) - kept)
            settled.append((state, one.token_ids[kept - 1] + 1))
        else:
            runner.keep_path(state, kept)
            settled.append((state, one.token_ids[kept[-1]] + 1))
    return settled


def decode(runner, target, shared: bool) -> tuple[list[torch.Tensor], list]:
    """Every request's logits over the rounds, and the hidden rows a drafter reads after each pass and
    after its settling: all requests' passes of a round through one `run` (shared), or each through its
    own extend / extend_tree; and the caches left."""
    states = requests(runner, target)
    logits = []
    for round_index in range(2):
        passes = round_passes(states, round_index)
        if shared:
            logits += runner.run(passes)
        else:
            logits += [runner.extend(one.state, one.token_ids) if one.parents is None
                       else runner.extend_tree(one.state, one.token_ids, one.parents) for one in passes]
        logits += hidden_rows(states)
        states = settle(runner, states, passes, round_index)
        logits += hidden_rows(states)
    return logits, [committed(state) for state, _ in states]


def hidden_rows(states) -> list[torch.Tensor]:
    rows = [state.hidden[layer].clone() for state, _ in states if state.reads for layer in state.reads.hidden_layers]
    assert len(rows) == 3
    return rows


def committed(state) -> list[torch.Tensor]:
    cache = state.cache
    if hasattr(cache, "keys") and isinstance(cache.keys, list):  # StaticKVCache
        return [keys[0, :, :state.cache_len].clone() for keys in cache.keys]
    return [layer.keys[0, :, :state.cache_len].clone() for layer in cache.layers]


class Recorder:
    """The number of requests in each compiled pass."""

    def __init__(self, fast):
        self.sizes, forward = [], fast.forward

        def recorded(parts):
            self.sizes.append(len(parts))
            return forward(parts)

        fast.forward = recorded


def assert_shared_is_alone(runner, target) -> None:
    alone, alone_caches = decode(runner, target, shared=False)
    shared, shared_caches = decode(runner, target, shared=True)
    assert len(shared) == len(alone) == 2 * (len(REQUESTS) + 2 * 3)
    for a, b in zip(shared, alone):
        assert torch.equal(a, b)
    for a, b in zip(shared_caches, alone_caches):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@NO_COMPILER
@pytest.mark.parametrize("dtype, quantization", [(torch.float32, None), (torch.bfloat16, None),
                                                 (torch.bfloat16, "int8"), (torch.float32, "w8a8")])
def test_requests_sharing_a_compiled_pass_get_their_own_passes_logits(zoo, dtype, quantization, one_thread):
    target = bitwise_target(zoo, dtype)
    runner = Runner(target.model, target.family)
    if quantization:
        runner.fast.quantize(quantization)
    recorder = Recorder(runner.fast)
    assert_shared_is_alone(runner, target)
    # the shared decode's rounds: 74 rows (over MAX_VERIFY_ROWS) as 3 requests' pass and 1's, then one pass of 4
    assert sum(len(rounds[0][0]) + 1 for _, rounds in REQUESTS) > MAX_VERIFY_ROWS
    assert recorder.sizes[-3:] == [3, 1, 4]


@NO_COMPILER
@pytest.mark.parametrize("arithmetic", ["float", "integer"])
def test_requests_sharing_a_pass_over_gguf_blocks_get_their_own_passes_logits(zoo, monkeypatch, arithmetic,
                                                                              one_thread):
    """Weights read from GGUF blocks (engine/packed.py): float32 rows, and integer rows, which make each
    row of x int8 on its own (engine/fast_blocks.h)."""
    from engine import packed
    from engine.fast_decode import FastDecoder
    from tests.test_packed import gguf_model

    monkeypatch.setenv("VLM_PACKED_WEIGHTS", "1")
    target = copy.copy(gguf_model(zoo.target("qwen2_vl")))
    target.model = copy.deepcopy(target.model)
    runner = Runner(target.model, target.family)
    runner.fast = FastDecoder(target.model, input_major=False)
    assert runner.fast.packed_bytes > 0
    runner.fast.use_weight_arithmetic(arithmetic)
    assert {w.arithmetic for w in runner.fast.weights() if isinstance(w, packed.PackedWeight)} == {arithmetic}
    recorder = Recorder(runner.fast)
    assert_shared_is_alone(runner, target)
    assert recorder.sizes[-3:] == [3, 1, 4]


@pytest.mark.parametrize("path", ["python layer", "transformers"])
def test_on_the_python_paths_each_request_runs_its_own_pass(zoo, path, one_thread):
    """The Python layer's products (torch.mm) and transformers' do not sum a row alone: each request's pass
    runs alone, and `run` moves each state on as extend / extend_tree do."""
    target = copy.copy(zoo.target("qwen2_vl"))
    target.model = copy.deepcopy(target.model)
    runner = Runner(target.model, target.family, fast=path == "python layer")
    if runner.fast is not None:
        runner.fast.stack.native = None
        assert not runner.fast.shares_passes(2, torch.float32)
    assert_shared_is_alone(runner, target)


@NO_COMPILER
def test_the_compiled_stack_refuses_to_share_a_pass_whose_products_would_not_sum_rows_alone(zoo, one_thread):
    """Input-major weights go to ATen's products, whose rows' sums depend on their neighbours: no sharing,
    and a shared pass asked anyway is refused, not answered with other bits."""
    from engine.fast_decode import FastDecoder

    target = bitwise_target(zoo, torch.float32)
    runner = Runner(target.model, target.family)
    runner.fast = FastDecoder(target.model, input_major=True)
    assert runner.fast.stack.native is not None and not runner.fast.shares_passes(2, torch.float32)
    states = requests(runner, target)
    runner.fast.shares_passes = lambda rows, dtype: True
    with pytest.raises(RuntimeError, match="sum each row alone"):
        runner.run(round_passes(states, 0)[:2])
