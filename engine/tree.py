"""Draft trees: several branches of a draft verified in one target pass (SpecInfer, EAGLE-2).

A draft is a tree of n nodes below the root, the last committed token (which is not a node):

    token_ids (n,)  each node's token
    parents   (n,)  each node's parent: an earlier node's index, or -1 for a child of the root
    probs     (n, V) or None: the distribution each node was drawn from (None: deterministic)

`Draft.parents = None` is a chain, the tree with one child per node (parents [-1, 0, 1, ...]).
Siblings are distinct tokens, ordered best first (the drafter's first choice is child 0).

Worked example (asserted in tests/test_tree.py). After committed token r, nodes 0..4:

    r ─ a(0) ─ b(1) ─ c(3)        token_ids [a, b, x, c, y]
      │     └─ x(2)               parents   [-1, 0, 0, 1, -1]
      └─ y(4)                     depths    [1, 2, 2, 3, 1]

The target runs [r, a, b, x, c, y] in one pass: row i (0 = r, 1 + j = node j) sees the
committed cache, itself and its ancestors (a 4-D attention mask), at rotary position
rope_pos + depth, so every row sits where plain decoding would put it (on M-RoPE targets all
three rows, rope_delta included). Greedy acceptance walks from r: if the target's choice after
r is a it goes on to a's row, if its choice there is x (the second child) the path is [0, 2]
and the target's choice after x is the bonus token. The cache then keeps r, a, x in order
(`Runner.keep_path`: the K/V entries of the path are moved into place, the rest dropped), as if
the target had decoded r, a, x plainly; the drafter's session follows the same path. A drafter
that reads the target's hidden states (EAGLE-3, the MTP head) gets the pass's rows of r, a, x, in that order,
as a chain pass over them would have left them.

Trees are drafted only where everything can keep one branch; otherwise the request drafts
chains and `Stats.tree_fallback` names why (engine/drafters/base.py `tree_fallback_reason`): a
drafter whose session cannot branch (the MTP layers of engine/drafters/mtp.py, DFlash and block
drafters, shared-cache assistants: they read the target's pass row by row; EAGLE-3 and the MTP
head branch), or a cache
with sliding-window or linear-attention layers (Gemma 3/4, MuseGlimmer, Qwen3.5), whose state
a tree pass would mix across branches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The most draft nodes a round verifies (a chain's tokens, a tree's nodes): the settings' range
# (engine/settings.py). A verify pass has one more row, the last committed token; the compiled
# stack's rows kernel takes passes of up to MAX_VERIFY_ROWS rows (engine/fast_layer.cpp), so each
# row of any verify pass is bitwise the one-token pass it replaces.
MAX_DRAFT_NODES = 64
MAX_VERIFY_ROWS = 1 + MAX_DRAFT_NODES


@dataclass
class Pass:
    """One request's pass over its own cache: token_ids (n,) appended as a chain (`Runner.extend`), or as
    draft-tree entries when `parents` is given (`Runner.extend_tree`, which says what parents holds).
    `Runner.run` takes several requests' passes of one round."""

    state: object  # engine/runner.py CacheState (the model's cache for this request)
    token_ids: list[int]
    parents: list[int] | None = None


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each entry, 0 for an entry whose parent is -1 (parents[i] < i)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """(T, T) bool: row i is True at i and at each of its ancestors."""
    seen = torch.eye(len(parents), dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            seen[i] |= seen[parent]
    return seen


def chain_parents(num_nodes: int) -> list[int]:
    return list(range(-1, num_nodes - 1))


def children_of(parents: list[int]) -> list[list[int]]:
    """children[i + 1] = the children of node i in order; children[0] = the root's."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        children[parent + 1].append(node)
    return children


def best_nodes(parents: list[int], scores: list[float], budget: int) -> list[int]:
    """The `budget` nodes of highest score, ties to the shallower and then the earlier node, in
    index order. With each score at most its parent's the choice is a tree (a node's parent is
    kept before it)."""
    depths = tree_depths(parents)
    ranked = sorted(range(len(parents)), key=lambda i: (-scores[i], depths[i], i))
    return sorted(ranked[:budget])


def grow_level(beam: list[int], top, branching: int, token_ids: list[int], parents: list[int],
               scores: list[float]) -> list[int]:
    """One level of a top-k draft tree (EAGLE-2's expansion): each node of `beam` (-1: the root)
    gets the children of its row of `top` (a `topk` of (len(beam), branching) probabilities) with
    p > 0, appended to `token_ids` / `parents` / `scores` (path probability); returns the next
    beam, the `branching` new nodes of the highest path probability."""
    first = len(token_ids)
    for parent, values, indices in zip(beam, top.values.tolist(), top.indices.tolist()):
        for p, token in zip(values, indices):
            if p > 0:
                token_ids.append(token)
                parents.append(parent)
                scores.append(p * (scores[parent] if parent >= 0 else 1.0))
    return sorted(range(first, len(token_ids)), key=lambda i: -scores[i])[:branching]


def subtree(token_ids: list[int], parents: list[int], kept: list[int]) -> tuple[list[int], list[int]]:
    """The tree of the nodes `kept` (ascending, each one's parent kept), re-indexed."""
    index = {node: i for i, node in enumerate(kept)}
    return [token_ids[i] for i in kept], [index[parents[i]] if parents[i] >= 0 else -1 for i in kept]


def depth(draft) -> int:
    """How deep the draft goes: its length for a chain, its deepest node's depth for a tree."""
    if draft.parents is None or not draft.parents:
        return len(draft.token_ids)
    return max(tree_depths(draft.parents)) + 1


def verify_pass(target, state, last_token: int, draft) -> Pass:
    """The target pass that verifies a draft: the last committed token and every node of the draft,
    whose logits (n+1, V) are row 0 after the last committed token, row 1 + i after node i."""
    tokens = [last_token] + draft.token_ids
    if draft.parents is None:
        if draft.token_ids:
            target.checkpoint(state)  # a rejection rolls back to here (engine/linear_attention_rollback.py)
        return Pass(state, tokens)
    return Pass(state, tokens, [-1] + [parent + 1 for parent in draft.parents])


def run_passes(target, passes: list[Pass]) -> list[torch.Tensor]:
    """The logits of each pass, all of them on `target`: one alone through its extend / extend_tree;
    several in Runner.run, which shares target passes among them where each request's logits stay
    bitwise those of its own pass (engine/runner.py)."""
    if len(passes) > 1:
        return target.run(passes)
    return [target.extend(one.state, one.token_ids) if one.parents is None
            else target.extend_tree(one.state, one.token_ids, one.parents) for one in passes]


def verify(target, state, last_token: int, draft) -> torch.Tensor:
    """One target pass over the last committed token and every node of the draft: logits
    (n+1, V), row 0 after the last committed token, row 1 + i after node i."""
    return run_passes(target, [verify_pass(target, state, last_token, draft)])[0]


def keep(target, state, draft, path: list[int]) -> None:
    """Keep the last committed token and the accepted `path` (node indices) in the target's cache."""
    if draft.parents is None:
        target.rollback(state, len(draft.token_ids) - len(path))
    else:
        target.keep_path(state, [0] + [node + 1 for node in path])
