"""Statistics of one request, updated in one place by the decode loop.

Conventions:
- The first answer token comes from the prefill pass. `ttft_s` runs from the request's start
  to that token: `prepare_s` (decoding, shrinking and processing the images, rendering and
  tokenizing the prompt) plus `prefill_s`. `total_s` also counts from the request's start.
- `target_forwards` counts decode/verify passes of the target after prefill. Each yields the
  accepted draft tokens plus one bonus token, so `tokens_per_forward` =
  decode_tokens / target_forwards COUNTS THE BONUS TOKEN (as vLLM's mean accepted length
  does): plain decoding gives exactly 1.0.
- `decode_tokens` are the tokens after the first; `decode_tok_s` = decode_tokens / decode_s,
  where decode_s runs from the first token to the last.
- `acceptance` = accepted / drafted over the answer (None when nothing was drafted): the one
  acceptance figure shown anywhere (panels, notes, A/B verdict, benchmark). A server that
  only publishes server-wide counters (vLLM's /metrics) gives `drafts_approximate` (why) when
  other requests may have drafted during this one (engine/backends/metrics.py).
- `draft_length_reason` says in words why the latest round drafted the k it did; when the cost
  rule stopped drafting it starts with PAUSED (`drafting_paused`). The plain steps the cost rule
  takes now and then to time plain decoding (REFERENCE) show in `draft_lengths` as 0 but leave
  the reason and `draft_length_changes` alone.
- `accepted_by_position[i]`: rounds whose draft token i was accepted; `drafted_by_position[i]`:
  rounds that drafted a token i.
- Draft trees (engine/tree.py): `drafted` counts the nodes verified, `accepted` the nodes of
  the accepted paths, so `acceptance` is per node; token i is the node at depth i + 1 (the
  by-position lists count rounds whose tree reached / whose accepted path reached that depth).
  `nodes_per_forward` = drafted / target_forwards; `accepted_depth` = accepted /
  target_forwards, the mean accepted path (chains too: tokens_per_forward - 1).
  `tree_fallback` says why chains were drafted although a tree was asked.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field, fields

import torch


PAUSED = "drafting paused: it cost more than it saved"  # a draft-length reason's start (engine/draft_length.py)
TOO_FEW = "too few tokens to measure the speed"  # an answer without Stats.speed_measured
REFERENCE = "a plain step, to time plain decoding at the same moment as drafting"  # not shown as a reason


class Clock:
    """Wall clock that waits for the accelerator before reading the time."""

    def __init__(self, device):
        self.sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else None

    def now(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter()


@dataclass
class Stats:
    mode: str = "plain"  # "plain" or "speculative"
    drafter: str | None = None
    drafter_kind: str | None = None
    prefill_tokens: int = 0
    prefill_image_tokens: int = 0
    max_image_tokens: int | None = None  # the budget of tokens per image (None: the processor's own limit)
    prefill_s: float = 0.0
    prepare_s: float = 0.0  # from the request's start to the prefill: images, prompt, the wait for the engine
    queue_wait_s: float = 0.0  # the part of prepare_s spent waiting in the caller's queue (the app's), as it measured it
    ttft_s: float = 0.0
    drafter_prefill_s: float = 0.0  # the drafter's own prefill (begin), after the first token
    decode_tokens: int = 0
    decode_s: float = 0.0
    decode_tok_s: float = 0.0
    total_s: float = 0.0
    new_tokens: int = 0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected_rounds: int = 0  # rounds that rejected a draft token
    acceptance: float | None = None
    drafts_approximate: str | None = None  # why drafted / accepted may count other requests' drafts too
    tokens_per_forward: float | None = None
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)  # k used in each round (a tree's nodes)
    draft_length_reason: str | None = None  # why the latest round drafted the k it did
    draft_length_changes: list[dict] = field(default_factory=list)  # {"token", "k", "reason"} when k changed
    auto_choice: str | None = None  # with drafter "auto": which drafter was picked and why
    draft_shape: str = "chain"  # "chain" or "tree"
    tree_fallback: str | None = None  # why chains, when a tree was asked
    nodes_per_forward: float | None = None  # draft nodes verified per target pass
    accepted_depth: float | None = None  # accepted draft tokens per target pass
    fallback_reason: str | None = None
    finish_reason: str | None = None  # "stop_token", "max_new_tokens", "context" (the context is full), "stopped"
    tok_s_curve: list[float] = field(default_factory=list)  # running decode tok/s after each round
    unknown: tuple[str, ...] = ()  # fields the backend cannot measure (engine/backend.py): None in as_dict

    @property
    def speed_measured(self) -> bool:
        """There is a decode speed to show: at least two decode tokens, timed. Every figure that
        names the speed or a ratio of speeds (panel, summary, A/B) follows this one rule."""
        return self.decode_tokens > 1 and self.decode_tok_s > 0 and "decode_tok_s" not in self.unknown

    @property
    def drafting_paused(self) -> bool:
        """The cost rule had stopped drafting when the latest round began (it may resume)."""
        return (self.draft_length_reason or "").startswith(PAUSED)

    def record_round(self, num_drafted: int, num_accepted: int, num_emitted: int, depth: int | None = None) -> None:
        """One verify pass: `num_drafted` proposed (nodes), `num_accepted` kept, `num_emitted`
        output; `depth`: how deep a tree went (a chain: num_drafted)."""
        self.target_forwards += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.rejected_rounds += num_accepted < num_drafted
        self.decode_tokens += num_emitted
        self.draft_lengths.append(num_drafted)
        for position in range(num_drafted if depth is None else depth):
            if position >= len(self.drafted_by_position):
                self.drafted_by_position.append(0)
                self.accepted_by_position.append(0)
            self.drafted_by_position[position] += 1
            self.accepted_by_position[position] += position < num_accepted
        self.acceptance = self.accepted / self.drafted if self.drafted else None
        self.tokens_per_forward = self.decode_tokens / self.target_forwards
        self.nodes_per_forward = self.drafted / self.target_forwards
        self.accepted_depth = self.accepted / self.target_forwards

    def record_draft_length(self, token: int, k: int, reason: str) -> None:
        """The k chosen before answer token `token` and why; a change is logged (up to 64)."""
        if reason == REFERENCE:
            return
        if (not self.draft_length_changes or self.draft_length_changes[-1]["k"] != k) \
                and len(self.draft_length_changes) < 64:
            self.draft_length_changes.append({"token": token, "k": k, "reason": reason})
        self.draft_length_reason = reason

    def record_time(self, started: float, first_token_at: float, now: float) -> None:
        self.total_s = now - started + self.prepare_s
        self.decode_s = now - first_token_at
        self.decode_tok_s = self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0
        self.tok_s_curve.append(round(self.decode_tok_s, 2))

    def snapshot(self) -> Stats:
        """A copy that later rounds do not change (lists copied, their items are never mutated)."""
        snapshot = copy.copy(self)
        for name in LIST_FIELDS:
            setattr(snapshot, name, list(getattr(self, name)))
        return snapshot

    def as_dict(self) -> dict:
        values = asdict(self)
        return {**values, **{name: None for name in self.unknown}}

    def summary(self) -> str:
        """One line for a chat history or a log."""
        speed = f"{self.decode_tok_s:.1f} tok/s" if self.speed_measured else TOO_FEW
        parts = [speed, f"TTFT {self.ttft_s * 1000:.0f} ms"]
        if self.drafting_paused:
            parts.append(PAUSED)
        if self.acceptance is not None:
            parts.append(f"acceptance {self.acceptance:.0%} ({self.accepted} of {self.drafted} drafted"
                         + (", approximate)" if self.drafts_approximate else ")"))
        if self.tokens_per_forward is not None and self.acceptance is not None:  # another backend may not say
            parts.append(f"{self.tokens_per_forward:.2f} tok/forward")
        if self.draft_shape == "tree":
            parts.append(f"tree: {self.nodes_per_forward:.1f} nodes/forward, accepted depth {self.accepted_depth:.2f}")
        if self.fallback_reason:
            parts.append(f"fell back to plain: {self.fallback_reason}")
        return " · ".join(parts)


LIST_FIELDS = tuple(f.name for f in fields(Stats) if f.default_factory is list)
