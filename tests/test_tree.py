"""Draft trees (engine/tree.py): the worked examples, forced acceptance of branches that are not
the first child on tiny real models (M-RoPE with images, 1-axis RoPE), the model drafter's cache
following the accepted branch, and chains with a named reason where trees cannot be kept."""

from __future__ import annotations

import pytest
import torch

from engine.drafters.ngram import lookup_all, trie
from engine.engine import Engine
from engine.loop import DecodeSettings, Done
from engine.sampling import Sampler, SamplingSettings, accept_tree
from engine.tree import ancestor_mask, best_nodes, tree_depths
from tests.mocks import ScriptedTreeDrafter
from measure.exactness import conversation

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_NEW = 24


def path_to(parents: list[int], node: int) -> list[int]:
    """The nodes from a child of the root down to `node`, in order."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_tree_worked_example():
    """engine/tree.py's docstring: nodes a b x c y under r, parents [-1, 0, 0, 1, -1]."""
    a, b, x, c, y = 10, 11, 12, 13, 14
    tokens, parents = [a, b, x, c, y], [-1, 0, 0, 1, -1]
    assert [d + 1 for d in tree_depths(parents)] == [1, 2, 2, 3, 1]
    assert path_to(parents, 3) == [0, 1, 3]
    assert ancestor_mask(parents)[3].tolist() == [True, True, False, True, False]
    # Target choices: after r -> a, after a -> x (the second child), after x -> 99 (the bonus).
    logits = torch.zeros(6, 100)
    for row, choice in [(0, a), (1, x), (3, 99), (2, c), (4, 5), (5, 5)]:
        logits[row, choice] = 1.0
    assert accept_tree(Sampler(SamplingSettings()), tokens, parents, None, logits) == ([0, 2], 99)
    assert best_nodes([-1, 0, -1, 2], [0.5, 0.4, 0.3, 0.3], 3) == [0, 1, 2]


def test_ngram_trie_worked_example():
    """engine/drafters/ngram.py's docstring."""
    continuations = lookup_all([5, 6, 7, 5, 6, 8, 5, 6], 3, 1, 2, frozenset())
    assert continuations == [[8, 5, 6], [7, 5, 6]]
    draft = trie(continuations, budget=4, branching=2)
    assert (draft.token_ids, draft.parents) == ([8, 5, 7, 5], [-1, 0, -1, 2])
    assert trie(continuations, budget=10, branching=1).token_ids == [8, 5, 6]  # one child a node


def answer(target, messages, drafter=None, k=4, draft_tree=0):
    engine = Engine(target, {"drafter": drafter} if drafter else {})
    decode = DecodeSettings(max_new_tokens=MAX_NEW, draft_tokens=k, draft_tree=draft_tree,
                            stop_token_ids=frozenset({-1}))
    done = list(engine.stream(messages, drafter="drafter" if drafter else None, decode=decode))[-1]
    assert isinstance(done, Done)
    return done


@pytest.mark.parametrize("family, num_images", [("qwen2_vl", 0), ("qwen2_vl", 2), ("qwen3_vl", 1), ("llava", 1)])
def test_forced_tree_acceptance_takes_branches_that_are_not_the_first_child(zoo, family, num_images):
    """Trees built around the true answer with a decoy beside every true node (first or second
    child, with a child of its own): each round accepts exactly the true branch, the answer is
    plain greedy's, and the cache kept only that branch (with a crop instead of the compaction,
    the answer changes)."""
    target = zoo.target(family)
    messages = conversation(num_images)
    truth = answer(target, messages).token_ids
    drafter = ScriptedTreeDrafter(truth, target.placeholder_ids)
    done = answer(target, messages, drafter, draft_tree=1)
    assert done.token_ids == truth
    assert done.stats.draft_shape == "tree" and done.stats.tree_fallback is None
    assert drafter.paths == drafter.expected[:len(drafter.paths)]
    assert max(map(len, drafter.paths)) >= 3 and drafter.second_child_accepted >= 3
    assert done.stats.accepted == sum(map(len, drafter.paths))

    runner, keep_path = target.runner, type(target.runner).keep_path

    def crop_only(self, state, path):  # keeps the first len(path) entries, whatever the path
        keep_path(self, state, list(range(len(path))))

    type(runner).keep_path = crop_only
    try:
        broken = answer(target, messages, ScriptedTreeDrafter(truth, target.placeholder_ids), draft_tree=1)
    finally:
        type(runner).keep_path = keep_path
    assert broken.token_ids != truth


def test_model_drafter_follows_the_accepted_branch(zoo):
    """After accepting a branch that is not the first child, the text drafter's next tree equals
    the one a fresh session drafts from the same committed answer."""
    target, drafter = zoo.target("qwen2_vl"), zoo.drafter("qwen2_vl", "text_drafter")
    prompt = Engine(target).prepare(conversation(1))
    logits, state = target.runner.prefill(prompt.target_inputs)
    sampler = Sampler(SamplingSettings())
    session = drafter.begin(prompt, state)
    generated, total_kept = [int(logits.argmax())], 0
    for _ in range(3):
        draft = session.propose_tree(generated, 3, 6, 2, sampler)
        parents = draft.parents
        second = {n for n in range(len(parents)) if parents.index(parents[n]) != n}  # not a first child
        run = session.tree[1]  # the nodes the drafter ran (their entries are in its cache)

        def choice(node):  # through a second child, with as many run nodes as can be
            p = path_to(parents, node)
            return bool(second & set(p)), sum(m in run for m in p), len(p)

        path = path_to(parents, max(range(len(parents)), key=choice))
        assert second & set(path), draft
        session.accept(len(path), path)
        kept = len(session.cached_answer) - len(generated)  # the path's nodes the drafter ran
        assert kept >= 1 and session.cached_answer == generated + [draft.token_ids[n] for n in path[:kept]]
        total_kept += kept
        generated += [draft.token_ids[n] for n in path] + [7]
    mine = session.propose_tree(generated, 3, 6, 2, sampler)
    fresh = drafter.begin(prompt, state).propose_tree(generated, 3, 6, 2, sampler)
    assert (mine.token_ids, mine.parents) == (fresh.token_ids, fresh.parents)
    assert session.cached_answer == generated and total_kept > 3  # accepted branches stayed in its cache


@pytest.mark.parametrize("role", ["text_drafter", "ngram"])
def test_sampled_tree_answers_are_reproducible(zoo, role):
    """Sampling with trees (deterministic nodes, multi-draft rejection sampling) runs on a real
    target without falling back; equal seeds give equal answers."""
    target = zoo.target("qwen2_vl")
    engine = Engine(target, {role: zoo.drafter("qwen2_vl", role)})
    decode = DecodeSettings(max_new_tokens=12, draft_tokens=3, draft_tree=5, stop_token_ids=frozenset({-1}))
    runs = [list(engine.stream(conversation(1), drafter=role, decode=decode,
                               sampling=SamplingSettings(temperature=1.0, seed=3)))[-1] for _ in range(2)]
    assert runs[0].stats.draft_shape == "tree" and runs[0].stats.fallback_reason is None
    assert runs[0].token_ids == runs[1].token_ids


def test_sliding_window_target_drafts_chains_with_a_reason(zoo):
    target = zoo.target("gemma3")
    plain = answer(target, conversation(1))
    done = answer(target, conversation(1), zoo.drafter("gemma3", "ngram"), draft_tree=6)
    assert done.token_ids == plain.token_ids
    assert done.stats.draft_shape == "chain" and "sliding-window" in done.stats.tree_fallback
