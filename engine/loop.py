"""The decode loop: the engine's one streaming generator.

Plain decoding is the same loop with no drafter: every draft is empty and each verify pass
decodes one token. The CLI, the app, the A/B mode and the benchmark all consume `generate`.

`answer` is the loop itself, for one request: it yields its events and, at step 3, the target pass
it needs (a `PassRequest`), and goes on with that pass's logits sent back. `generate` runs those
passes at once, alone (`drive`); the engine's worker runs several requests' answers in rounds, each
round's passes in one shared target pass (engine/worker.py), each answer bitwise what it is alone.
"""

from __future__ import annotations

import threading
from collections.abc import Generator, Iterator
from contextlib import closing
from dataclasses import dataclass

import torch

from engine import tree
from engine.draft_length import DraftLength, PassCosts
from engine.drafters.base import Drafter, GuardedSession
from engine.prompt import Prompt
from engine.runner import NO_READS, Runner
from engine.sampling import Sampler, SamplingSettings, accept_tree
from engine.stats import Clock, Stats


@dataclass(frozen=True)
class DecodeSettings:
    max_new_tokens: int = 256
    draft_tokens: int | None = None  # k fixed; None: chosen each round from measured cost (draft_length.py)
    adaptive: bool = False  # the +2/-1 rule from draft_tokens (or 4): longer after a full acceptance
    max_draft_tokens: int = 8
    stop_token_ids: frozenset[int] = frozenset()
    draft_tree: int = 0  # > 0: draft trees of up to this many nodes, k deep (engine/tree.py); 0: chains
    tree_branching: int = 2  # a tree node's most children


@dataclass(frozen=True)
class RequestInfo:
    """What the caller knows of the request before decoding starts, for its statistics."""

    started: float | None = None  # the request's start (time.perf_counter()); None: when decoding starts
    context_cut: bool = False  # max_new_tokens was cut to the room left in the context: finish "context"
    auto_choice: str | None = None  # with drafter "auto": which drafter was picked and why


@dataclass
class Chunk:
    """New tokens of the answer. origins[i] is "draft" (an accepted draft token) or "target".
    Another backend (engine/backend.py) may leave token_ids and origins empty (unknown)."""

    text: str  # the new text since the previous chunk
    token_ids: list[int]
    origins: list[str]
    stats: Stats  # a snapshot: the statistics when this chunk was made
    spans: list[tuple[str, str]]  # the text by origin: [(accepted drafts' text, "draft"), (text, "target")]


@dataclass
class Done:
    text: str  # the whole answer
    token_ids: list[int]  # the generated ids (a final stop token included)
    stats: Stats


@dataclass
class PassRequest:
    """A target pass that `answer` needs before it goes on: `one` on `target`; its logits, (n, V), are
    sent back (an exception raised by the pass is thrown in)."""

    target: Runner
    one: tree.Pass
    beside: int = 0  # the other answers stepped in the same round (engine/worker.py), whose work is in its time


def generate(target: Runner, *args, **kwargs) -> Iterator[Chunk | Done]:
    """Answer a prompt alone: `answer`'s events (its arguments), each of its passes run at once."""
    return drive(answer(target, *args, **kwargs))


def drive(steps: Generator) -> Iterator[Chunk | Done]:
    """The events of one request's steps (`answer`, or the engine's around it), each PassRequest run
    alone on its target (tree.run_passes) and its logits sent back."""
    with closing(steps):
        item = next(steps, None)
        while item is not None:
            if isinstance(item, PassRequest):
                logits = tree.run_passes(item.target, [item.one])[0]
                try:
                    item = steps.send(logits)
                except StopIteration:
                    return
            else:
                yield item
                item = next(steps, None)


def answer(
    target: Runner,
    tokenizer,
    prompt: Prompt,
    drafter: Drafter | None,
    sampling: SamplingSettings,
    decode: DecodeSettings,
    stop: threading.Event | None = None,
    costs: PassCosts | None = None,
    request: RequestInfo = RequestInfo(),
) -> Generator[Chunk | Done | PassRequest, torch.Tensor, None]:
    """Answer `prompt`, yielding each event and each target pass it needs (its logits sent back);
    `costs`, the engine's measured pass costs, are read and updated to choose the draft length
    (engine/draft_length.py). Every event carries a snapshot of the statistics; times count from
    `request.started` (engine/stats.py)."""
    clock = Clock(target.device)
    started = clock.now()
    sampler = Sampler(sampling)
    stats = Stats(mode="speculative" if drafter else "plain",
                  drafter=drafter.name if drafter else None, drafter_kind=drafter.kind if drafter else None,
                  prefill_tokens=len(prompt.input_ids), prefill_image_tokens=prompt.num_image_tokens,
                  max_image_tokens=prompt.max_image_tokens, auto_choice=request.auto_choice,
                  prepare_s=0.0 if request.started is None else started - request.started)
    text = TextStream(tokenizer)
    # 1. Prefill the target (its logits give the first token, yielded at once; it keeps what
    #    the drafter reads; a long prompt in passes that a stop can end), then the drafter (a
    #    session of its own for this request), only if the answer goes on.
    logits, state = target.prefill(prompt.target_inputs, drafter.reads if drafter else NO_READS, stop)
    if logits is None:  # Stop during a long prompt's read (engine/runner.py): nothing answered
        stats.finish_reason = "stopped"
        yield Done("", [], stats.snapshot())
        return
    first_token, _ = sampler.next_token(logits)
    first_token_at = clock.now()
    stats.prefill_s = first_token_at - started
    stats.ttft_s = stats.total_s = stats.prepare_s + stats.prefill_s
    generated = [first_token]
    stats.new_tokens = 1
    yield _chunk(text, [first_token], 0, stats)
    drafting = GuardedSession(drafter, state, stats)  # every drafter call: a failure decodes plainly from there
    if not _finished(generated, decode, stats, stop, request):
        drafting.begin(prompt)
    tree_budget = _tree_budget(decode, target, drafting, stats)
    length = DraftLength(decode.draft_tokens, decode.adaptive, decode.max_draft_tokens, costs,
                         drafter.name if drafter else None, len(prompt.images))
    while not _finished(generated, decode, stats, stop, request):
        remaining = decode.max_new_tokens - len(generated)
        round_started = clock.now()
        # 2. Draft up to k tokens deep: a chain, or a tree of up to draft_tree nodes (none when
        #    plain, after a fallback, or when drafting is a loss).
        stats.record_draft_length(len(generated), length.k, length.reason)
        draft = drafting.propose(generated, min(length.k, remaining - 1), sampler, tree_budget, decode.tree_branching)
        drafted_at = clock.now()
        # 3. Verify: one target pass over the last committed token and every draft node, (n+1, V)
        #    (run by the caller: alone, or in one pass with other requests', bitwise the same).
        verify = PassRequest(target, tree.verify_pass(target, state, generated[-1], draft))
        target_logits = yield verify
        verified_at = clock.now()
        # 4. Accept the path of nodes the target agrees with plus the target's own bonus token.
        path, bonus_token = accept_tree(sampler, draft.token_ids, draft.parents, draft.probs, target_logits)
        # 5. Keep that path in the target's cache, drop the rest; the drafter learns the pass.
        tree.keep(target, state, draft, path)
        drafting.accept(draft, path, generated)
        new_tokens = _truncate([draft.token_ids[node] for node in path] + [bonus_token], remaining, decode)
        generated += new_tokens
        # 6. Statistics, then the next draft length from this round's counts and timings.
        depth = tree.depth(draft)
        stats.new_tokens = len(generated)
        stats.record_round(*_counted(len(draft.token_ids), len(path), len(new_tokens), depth))
        now = clock.now()
        stats.record_time(started, first_token_at, now)
        length.update(len(draft.token_ids) + 1, depth, len(path), draft.parents is not None,
                      drafted_at - round_started, verified_at - drafted_at, now - round_started, not verify.beside)
        yield _chunk(text, new_tokens, min(len(path), len(new_tokens)), stats)
    length.finish()
    stats.record_time(started, first_token_at, clock.now())
    yield Done(text.full(), generated, stats.snapshot())


def _chunk(text: TextStream, new_tokens: list[int], num_drafted: int, stats: Stats) -> Chunk:
    """The event for `new_tokens`, whose first `num_drafted` are accepted draft tokens."""
    spans = [(text.push(new_tokens[:num_drafted]), "draft"), (text.push(new_tokens[num_drafted:]), "target")]
    spans = [(piece, origin) for piece, origin in spans if piece]
    origins = ["draft"] * num_drafted + ["target"] * (len(new_tokens) - num_drafted)
    return Chunk("".join(piece for piece, _ in spans), new_tokens, origins, stats.snapshot(), spans)


def _tree_budget(decode: DecodeSettings, target, drafting: GuardedSession, stats: Stats) -> int:
    """The node budget of each draft tree; 0 for chains (the reason in stats when a tree was asked)."""
    if decode.draft_tree <= 0 or drafting.session is None:
        return 0
    stats.tree_fallback = drafting.tree_unsupported(target)
    stats.draft_shape = "chain" if stats.tree_fallback else "tree"
    return 0 if stats.tree_fallback else decode.draft_tree


def _truncate(tokens: list[int], remaining: int, decode: DecodeSettings) -> list[int]:
    """Cut at max_new_tokens and after the first stop token."""
    tokens = tokens[:remaining]
    for i, token in enumerate(tokens):
        if token in decode.stop_token_ids:
            return tokens[: i + 1]
    return tokens


def _counted(num_drafted: int, num_accepted: int, num_new: int, depth: int) -> tuple[int, int, int, int]:
    """(drafted, accepted, emitted, depth) as the statistics count them: when a stop token inside
    the accepted draft ends the answer, the draft tokens after it are neither drafted nor accepted."""
    if num_new < num_accepted + 1:
        return num_new, num_new, num_new, num_new
    return num_drafted, num_accepted, num_new, depth


def _finished(generated: list[int], decode: DecodeSettings, stats: Stats, stop, request: RequestInfo) -> bool:
    if generated[-1] in decode.stop_token_ids:
        stats.finish_reason = "stop_token"
    elif len(generated) >= decode.max_new_tokens:
        stats.finish_reason = "context" if request.context_cut else "max_new_tokens"
    elif stop is not None and stop.is_set():
        stats.finish_reason = "stopped"
    return stats.finish_reason is not None


class TextStream:
    """Incremental detokenization at a cost per chunk independent of the answer's length (as
    vLLM's detokenizer): decode a window that starts at the previous chunk's tokens, so that
    the tokenizer sees the new tokens' left neighbours, and emit what the new tokens add to it.
    An incomplete UTF-8 sequence (shown as U+FFFD) is held back until its bytes arrive.
    `full()` decodes the whole answer once, at the end."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.window_start = 0  # first token of the decoding window
        self.emitted_end = 0  # tokens whose text has been emitted

    def push(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        self.token_ids += token_ids
        before = self._decode(self.token_ids[self.window_start:self.emitted_end])
        text = self._decode(self.token_ids[self.window_start:])
        if text.endswith("\ufffd") or len(text) <= len(before):
            return ""
        self.window_start, self.emitted_end = self.emitted_end, len(self.token_ids)
        return text[len(before):]

    def full(self) -> str:
        return self._decode(self.token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
