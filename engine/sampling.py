"""Turning logits into tokens, and deciding which drafted tokens the target keeps.

Glossary (as in vLLM's rejection sampler):
- draft tokens:     the k tokens a drafter proposes after the last committed token.
- accepted tokens:  the longest prefix of the draft the target agrees with.
- bonus token:      the target's own token after the accepted prefix: when a draft token is
                    rejected it is the "recovered" token sampled from the residual
                    max(0, p - q); when all k are accepted it is sampled from the target's
                    distribution at position k+1. Every verify pass yields one.

Greedy (temperature 0): accept while draft[i] == argmax(target_logits[i]); the output is
identical to plain greedy decoding. Sampling: rejection sampling (Leviathan et al. 2023,
Chen et al. 2023), so the output distribution is exactly the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import fast_native
from engine.tree import chain_parents, children_of


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


class Sampler:
    """Warps logits into probabilities and draws from them with a per-request generator."""

    def __init__(self, settings: SamplingSettings):
        self.settings = settings
        self.generator = torch.Generator()
        if settings.seed is not None:
            self.generator.manual_seed(settings.seed)
        else:
            self.generator.seed()

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (..., V) -> probabilities (..., V) after temperature, top-k and top-p."""
        s = self.settings
        scaled = logits / s.temperature
        if bool((scaled == float("inf")).any() or scaled.isnan().any()):  # a temperature so small that the
            # largest logits overflow: the limit of the distribution as the temperature falls (the likeliest
            # tokens alone, alike), from the logits less their largest (0 stays 0, the rest go to -inf;
            # the temperature may be 0 in float32)
            shifted = logits - logits.amax(-1, keepdim=True)
            scaled = torch.where(shifted == 0, torch.zeros_like(shifted), shifted / s.temperature)
        logits = scaled
        if s.top_k > 0:
            kth = torch.topk(logits, min(s.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if s.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            drop_sorted = cumulative - sorted_logits.softmax(-1) >= s.top_p
            drop_sorted[..., 0] = False  # the likeliest token always stays (a top_p under float32's least is 0 here)
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits.softmax(-1)

    def draw(self, probs: torch.Tensor) -> int:
        """One token from probs (V,)."""
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator))

    def next_token(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """A token from logits (V,), and the distribution it was drawn from (None when greedy)."""
        if self.settings.greedy:
            return greedy_tokens(logits[None])[0], None
        probs = self.probs(logits)
        return self.draw(probs), probs

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator))


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, the first of equals, of logits (n, V): in the compiled module on a CPU
    (float32; ATen's argmax over a 49,152-token vocabulary costs about 80 us there), else ATen's."""
    native = fast_native.layer() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    return logits.argmax(-1).tolist() if native is None else native.argmax_rows(logits.contiguous())


def accept_tree(
    sampler: Sampler,
    draft_tokens: list[int],
    parents: list[int] | None,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
) -> tuple[list[int], int]:
    """Verify a draft tree (engine/tree.py) against the target: walk down from the root.

    draft_tokens:  (n,) the nodes' ids; parents (n,) each node's parent (-1: the root), None
                   for a chain.
    draft_probs:   (n, V) the distribution each node was drawn from, or None (deterministic).
    target_logits: (n+1, V) the target's logits after the root (row 0) and after node i (row 1 + i).
    Returns (path, bonus_token): the accepted nodes from the root down, and the target's token
    after the last of them.

    Greedy: go to the child that equals the target's argmax, so the path and the bonus token
    are what plain greedy decoding gives. Sampling, at each node with target distribution p
    (SpecInfer's multi-draft rejection sampling): try the children in order, accepting child c
    with probability min(1, p(c) / q(c)); after a rejection p becomes the normalized residual
    max(0, p - q). When all are rejected the bonus token is drawn from what is left of p. This
    keeps the target's distribution exactly when a node's children are one sampled child (q
    its distribution) or distinct deterministic tokens (q one-hot: each child is then taken
    with the probability p gives it among the tokens not yet rejected).
    """
    children = children_of(parents if parents is not None else chain_parents(len(draft_tokens)))
    path: list[int] = []
    row = 0  # the target's row after the path's last node: 0 for the root, 1 + i for node i
    if sampler.settings.greedy:
        target_choice = greedy_tokens(target_logits)  # (n+1,), one host sync
        while True:
            child = next((c for c in children[row] if draft_tokens[c] == target_choice[row]), None)
            if child is None:
                return path, target_choice[row]
            path.append(child)
            row = child + 1

    target_probs, draft_probs = _to_host(sampler.probs(target_logits), draft_probs)  # (n+1, V), (n, V) | None
    while True:
        p = target_probs[row]
        for child in children[row]:
            token = draft_tokens[child]
            q = draft_probs[child] if draft_probs is not None else _one_hot(token, p)
            if sampler.uniform() * float(q[token]) <= float(p[token]):  # accept with min(1, p/q)
                path.append(child)
                row = child + 1
                break
            residual = (p - q).clamp_min(0)
            if float(residual.sum()) <= 0:  # p == q numerically: any draw from p is right
                residual = p
            p = residual / residual.sum()
        else:
            return path, sampler.draw(p)


def _to_host(target_probs: torch.Tensor, draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Both distributions on the CPU in float32, in one transfer (one host sync a round, not one a node)."""
    if draft_probs is None:
        return target_probs.float().cpu(), None
    both = torch.cat([target_probs.float(), draft_probs.to(target_probs.device, torch.float32)]).cpu()
    return both[:len(target_probs)], both[len(target_probs):]


def _one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[token] = 1.0
    return q
