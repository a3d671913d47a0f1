"""Mock models whose logits the test chooses: a Markov chain over a small vocabulary.

`MarkovRunner` stands where the engine's Runner stands (prefill / extend / rollback, and
extend_tree / keep_path for draft trees): the logits after token t are `table[t]`. `MarkovDrafter` drafts from another table, so tests
control exactly where drafts agree with the target. Both mock drafters follow the drafter
contract (engine/drafters/base.py) and are their own session: `begin` returns the drafter.
`FaultyDrafter` raises in the drafter call a test names; `ForcedDrafter` wraps a real drafter
and forces its token choices (the forced-acceptance tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.drafters.base import Draft
from engine.loop import Done
from engine.prompt import Prompt
from engine.runner import NO_READS


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


@dataclass
class MarkovState:
    tokens: list[int]
    tree: list[int] | None = None  # a draft tree's tokens, until keep_path
    reading: bool = True  # computing what a drafter reads, until a fallback stops it

    @property
    def cache_len(self):
        return len(self.tokens)

    def stop_reading(self):
        self.reading = False


class MarkovRunner:
    device = torch.device("cpu")

    def __init__(self, table: torch.Tensor):
        self.table = table  # (V, V): logits after token i

    def prefill(self, inputs, reads=NO_READS, stop=None):
        tokens = inputs["input_ids"][0].tolist()
        self.state = MarkovState(tokens)  # the latest request's, for tests to inspect
        return self.table[tokens[-1]].clone(), self.state

    def extend(self, state, token_ids):
        state.tokens += token_ids
        return self.table[torch.tensor(token_ids)].clone()

    def checkpoint(self, state):
        pass

    def rollback(self, state, num_tokens):
        if num_tokens:
            del state.tokens[-num_tokens:]

    def extend_tree(self, state, token_ids, parents):
        state.tree = list(token_ids)
        return self.table[torch.tensor(token_ids)].clone()

    def keep_path(self, state, path):
        state.tokens += [state.tree[i] for i in path]
        state.tree = None

    def tree_unsupported(self, state):
        return None


def prompt_of(ids, placeholder_ids=()):
    return Prompt([], [], {"input_ids": torch.tensor([ids])}, frozenset(placeholder_ids))


class MarkovDrafter:
    """Drafts from its own table (greedy, or sampled with the request's sampler)."""

    kind = "mock"
    reads = NO_READS

    def __init__(self, table: torch.Tensor, name="markov"):
        self.table, self.name = table, name
        self.accepted: list[int] = []

    def begin(self, prompt, target_state):
        self.accepted = []
        return self

    def propose(self, generated, k, sampler):
        tokens, probs, last = [], [], generated[-1]
        for _ in range(k):
            last, p = sampler.next_token(self.table[last].clone())
            tokens.append(last)
            probs.append(p)
        return Draft(tokens, None if sampler.settings.greedy else torch.stack(probs))

    def accept(self, num_accepted, path=None):
        self.accepted.append(num_accepted)

    def propose_tree(self, generated, depth, budget, branching, sampler):
        """The drafter's `branching` likeliest tokens after generated[-1], each followed by its
        greedy chain down to `depth`: deterministic nodes (no probs), distinct siblings."""
        token_ids, parents = [], []
        for first in self.table[generated[-1]].topk(branching).indices.tolist():
            parent, token = -1, first
            for _ in range(depth):
                token_ids.append(token)
                parents.append(parent)
                parent, token = len(token_ids) - 1, int(self.table[token].argmax())
        return Draft(token_ids, parents=parents)

    def tree_unsupported(self):
        return None


class ScriptedDrafter(MarkovDrafter):
    """Proposes the given continuation of the answer, optionally failing after some rounds."""

    def __init__(self, continuation, fail_at_round=None, fail_at_begin=False):
        super().__init__(None, "scripted")
        self.continuation, self.fail_at_round, self.fail_at_begin = continuation, fail_at_round, fail_at_begin
        self.rounds = 0

    def begin(self, prompt, target_state):
        if self.fail_at_begin:
            raise RuntimeError("drafter exploded at begin")
        return self

    def propose(self, generated, k, sampler):
        self.rounds += 1
        if self.fail_at_round is not None and self.rounds >= self.fail_at_round:
            raise RuntimeError("drafter exploded mid-answer")
        return Draft(self.continuation[len(generated):len(generated) + k])


class FaultyDrafter(MarkovDrafter):
    """Drafts from its table (the target's own: every draft is right), except that the `call`-th
    call of `method` ("begin", "propose", "propose_tree", "accept" or "tree_unsupported") raises.
    `calls_after_fault` counts every call made to it after that."""

    def __init__(self, table: torch.Tensor, method: str, call: int = 1):
        super().__init__(table, "faulty")
        self.method, self.call, self.calls = method, call, 0
        self.faulted, self.calls_after_fault = False, 0

    def _called(self, method: str) -> None:
        self.calls_after_fault += self.faulted
        self.calls += method == self.method
        if method == self.method and self.calls == self.call:
            self.faulted = True
            raise RuntimeError(f"{method} exploded")

    def begin(self, prompt, target_state):
        self._called("begin")
        return super().begin(prompt, target_state)

    def propose(self, generated, k, sampler):
        self._called("propose")
        return super().propose(generated, k, sampler)

    def propose_tree(self, generated, depth, budget, branching, sampler):
        self._called("propose_tree")
        return super().propose_tree(generated, depth, budget, branching, sampler)

    def accept(self, num_accepted, path=None):
        self._called("accept")
        super().accept(num_accepted, path)

    def tree_unsupported(self):
        self._called("tree_unsupported")
        return super().tree_unsupported()


def expected_accepts(truth: list[int], proposed: list[int], draft_lengths: list[int]) -> list[int]:
    """Replay: each round accepts the longest prefix of its draft that equals the truth, then
    the target adds one token. The first answer token comes from prefill."""
    position, accepts = 1, []
    for k in draft_lengths:
        draft = proposed[position:position + k]
        accepted = 0
        while accepted < len(draft) and draft[accepted] == truth[position + accepted]:
            accepted += 1
        accepts.append(accepted)
        position += accepted + 1
    return accepts


class ScriptedTreeDrafter(ScriptedDrafter):
    """Drafts trees around the given continuation of the answer. Round r puts its first
    `r % (depth + 1)` true tokens on one branch; beside each true node hangs a decoy (true + 1,
    with a child of its own), first at even depths, second at odd ones, so the accepted branch
    is often not the first child. A true branch stops before a placeholder id. `paths` records
    the accepted path's tokens each round."""

    def __init__(self, continuation, placeholder_ids=frozenset()):
        super().__init__(continuation)
        self.placeholder_ids = placeholder_ids
        self.expected: list[list[int]] = []  # the true tokens each tree holds
        self.paths: list[list[int]] = []
        self.second_child_accepted = 0  # accepted nodes that were not their parent's first child

    def propose_tree(self, generated, depth, budget, branching, sampler):
        self.rounds += 1
        true = []
        for token in self.continuation[len(generated):len(generated) + self.rounds % (depth + 1)]:
            if token in self.placeholder_ids:
                break
            true.append(token)
        token_ids, parents, parent = [], [], -1

        def add(token, parent):
            token_ids.append(token)
            parents.append(parent)
            return len(token_ids) - 1

        for level, token in enumerate(true):
            if level % 2 == 0:
                decoy, node = add(token + 1, parent), add(token, parent)
            else:
                node, decoy = add(token, parent), add(token + 1, parent)
            add(token + 2, decoy)
            parent = node
        self.expected.append(true)
        self.tree = (token_ids, parents)
        return Draft(token_ids, parents=parents) if token_ids else Draft([])

    def accept(self, num_accepted, path=None):
        token_ids, parents = self.tree
        path = path or []
        self.paths.append([token_ids[node] for node in path])
        self.second_child_accepted += sum(parents.index(parents[node]) != node for node in path)


# Answer positions whose token a forced drafter gets wrong. Chosen so that drafts of 2 and of 4
# tokens meet rejections at every offset (0 .. k-1 accepted) as well as full acceptances.
CORRUPTED = (3, 4, 9, 13, 15, 16, 21)


def corrupt(truth: list[int], positions=CORRUPTED) -> list[int]:
    """The true answer with the tokens at `positions` replaced by another id of the vocabulary
    (the one below, or 1 for id 0: the one above could be past the last id)."""
    corrupted = list(truth)
    for i in positions:
        corrupted[i] = truth[i] - 1 if truth[i] > 0 else 1
    return corrupted


def assert_forced_acceptance(done: Done, truth: list[int], proposed: list[int], accepted: list[int]):
    assert done.token_ids == truth
    assert done.stats.fallback_reason is None
    assert accepted == expected_accepts(truth, proposed, done.stats.draft_lengths)
    rounds = list(zip(done.stats.draft_lengths, accepted))
    assert any(a == 0 < k for k, a in rounds), rounds  # a rejection of the first draft token,
    assert any(0 < a < k for k, a in rounds), rounds  # one after an accepted prefix,
    assert any(a == k > 1 for k, a in rounds), rounds  # and a whole draft accepted


class ForcedSampler:
    """Stands in for the request's sampler inside one `propose`: the drafter computes its logits
    as always, but its i-th draw returns continuation[first + i]. The logits are kept."""

    def __init__(self, settings, continuation: list[int], first: int):
        self.settings, self.continuation, self.first = settings, continuation, first
        self.logits: list[torch.Tensor] = []

    def next_token(self, logits: torch.Tensor):
        token = self.continuation[self.first + len(self.logits)]
        self.logits.append(logits.clone())
        return token, None


class ForcedDrafter:
    """A real drafter whose token choices are forced to `continuation`; records every round's
    (answer length, drafter logits) and the accepted counts."""

    def __init__(self, inner, continuation: list[int]):
        self.inner, self.continuation = inner, continuation
        self.name, self.kind, self.reads = inner.name, inner.kind, inner.reads
        self.rounds: list[tuple[int, list[torch.Tensor]]] = []
        self.accepted: list[int] = []
        self.session = None

    def begin(self, prompt, target_state):
        self.session = self.inner.begin(prompt, target_state)
        return self

    def propose(self, generated, k, sampler):
        forced = ForcedSampler(sampler.settings, self.continuation, len(generated))
        draft = self.session.propose(generated, k, forced)
        assert draft.token_ids == self.continuation[len(generated):len(generated) + len(draft.token_ids)]
        self.rounds.append((len(generated), forced.logits))
        return draft

    def accept(self, num_accepted):
        self.accepted.append(num_accepted)
        self.session.accept(num_accepted)


def assert_tree_nodes_are_top_choices(target, drafter, prompt, reference) -> None:
    """A tree of a fresh session (3 deep, 10 nodes, 2 children a node): the root's children and each
    expanded node's children are the 2 best tokens of `reference(target, drafter, prompt, tokens,
    draft)` (a from-scratch drafting after `tokens` with `draft` fed) after that node's path, best first."""
    from engine.sampling import Sampler, SamplingSettings
    from engine.tree import children_of, tree_depths

    logits, state = target.runner.prefill(prompt.target_inputs, drafter.reads)
    generated = [int(logits.argmax())]
    draft = drafter.begin(prompt, state).propose_tree(generated, 3, 10, 2, Sampler(SamplingSettings()))
    assert len(draft.token_ids) == 10 and max(tree_depths(draft.parents)) == 2
    children = children_of(draft.parents)
    for node in [-1] + [n for n in range(len(draft.parents)) if children[n + 1]]:
        path, at = [], node  # the nodes from a child of the root down to `node`
        while at >= 0:
            path.append(at)
            at = draft.parents[at]
        path.reverse()
        expected = reference(target, drafter, prompt, prompt.input_ids + generated, [draft.token_ids[n] for n in path])
        assert [draft.token_ids[c] for c in children[node + 1]] == expected[-1].topk(2).indices.tolist()
