"""The decode loop: the engine's one streaming generator.

Plain decoding is the same loop with no drafter: every draft is empty and each verify pass
decodes one token. The CLI, the app, the A/B mode and the benchmark all consume `generate`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

from engine.drafters.base import Draft, Drafter, DrafterUnavailable
from engine.prompt import Prompt
from engine.runner import Runner
from engine.sampling import Sampler, SamplingSettings, accept_draft
from engine.stats import Clock, Stats


@dataclass(frozen=True)
class DecodeSettings:
    max_new_tokens: int = 256
    draft_tokens: int = 4  # k; with adaptive, the starting k
    adaptive: bool = False  # longer drafts after full acceptance, shorter after a rejection
    max_draft_tokens: int = 8
    stop_token_ids: frozenset[int] = frozenset()


@dataclass
class Chunk:
    """New tokens of the answer. origins[i] is "draft" (an accepted draft token) or "target"."""

    text: str  # the new text since the previous chunk
    token_ids: list[int]
    origins: list[str]
    stats: Stats  # live: updated as the answer grows


@dataclass
class Done:
    text: str  # the whole answer
    token_ids: list[int]  # the generated ids (a final stop token included)
    stats: Stats


def generate(
    target: Runner,
    tokenizer,
    prompt: Prompt,
    drafter: Drafter | None,
    sampling: SamplingSettings,
    decode: DecodeSettings,
    stop: threading.Event | None = None,
) -> Iterator[Chunk | Done]:
    clock = Clock(target.device)
    started = clock.now()
    sampler = Sampler(sampling)
    stats = Stats(mode="speculative" if drafter else "plain",
                  drafter=drafter.name if drafter else None, drafter_kind=drafter.kind if drafter else None,
                  prefill_tokens=len(prompt.input_ids), prefill_image_tokens=prompt.num_image_tokens)
    text = TextStream(tokenizer)
    try:
        # 1. Prefill the target (its logits give the first token) and the drafter.
        logits, state = target.prefill(prompt.target_inputs, **_hidden_request(drafter))
        drafter = _begin(drafter, prompt, stats, state)
        first_token, _ = sampler.next_token(logits)
        first_token_at = clock.now()
        stats.prefill_s = stats.ttft_s = first_token_at - started
        generated = [first_token]
        stats.new_tokens = 1
        yield Chunk(text.push([first_token]), [first_token], ["target"], stats)
        k = decode.draft_tokens
        while not _finished(generated, decode, stats, stop):
            remaining = decode.max_new_tokens - len(generated)
            # 2. Draft up to k tokens (none when plain or after a fallback).
            draft = _propose(drafter, generated, min(k, remaining - 1), sampler, stats)
            if draft is None:
                drafter = _stop_reading(state)
                draft = Draft([])
            # 3. Verify: one target pass over the last committed token and the draft, (k+1, V).
            target_logits = target.extend(state, [generated[-1]] + draft.token_ids)
            # 4. Accept the agreeing prefix plus the target's own bonus token.
            num_accepted, bonus_token = accept_draft(sampler, draft.token_ids, draft.probs, target_logits)
            # 5. Roll back the rejected draft tokens in the target's cache.
            target.rollback(state, len(draft.token_ids) - num_accepted)
            if drafter is not None:
                drafter.accept(num_accepted)
            new_tokens = _truncate(draft.token_ids[:num_accepted] + [bonus_token], remaining, decode)
            origins = ["draft"] * min(num_accepted, len(new_tokens)) + ["target"] * (len(new_tokens) - num_accepted)
            generated += new_tokens
            # 6. Statistics, then the next draft length.
            stats.new_tokens = len(generated)
            stats.record_round(len(draft.token_ids), num_accepted, len(new_tokens))
            stats.record_time(started, first_token_at, clock.now())
            k = _next_draft_length(k, len(draft.token_ids), num_accepted, decode)
            yield Chunk(text.push(new_tokens), new_tokens, origins, stats)
        stats.record_time(started, first_token_at, clock.now())
        yield Done(text.full(), generated, stats)
    finally:
        if drafter is not None:
            drafter.end()


def _hidden_request(drafter: Drafter | None) -> dict:
    """A drafter that reads the target names the hidden states (and shared K/V) each target pass
    keeps for it."""
    layers = getattr(drafter, "target_layers", ())
    request = {"hidden_layers": layers} if layers else {}
    if getattr(drafter, "shares_kv", False):
        request["share_kv"] = True
    return request


def _begin(drafter: Drafter | None, prompt: Prompt, stats: Stats, target_state) -> Drafter | None:
    if drafter is None:
        return None
    try:
        if getattr(drafter, "target_layers", ()):
            drafter.begin(prompt, target_state)
        else:
            drafter.begin(prompt)
        return drafter
    except Exception as error:  # any drafter failure falls back to plain decoding
        stats.fallback_reason = _reason(error, "at prefill")
        drafter.end()
        return _stop_reading(target_state)


def _stop_reading(target_state) -> None:
    """After a fallback the target computes no hidden states any more; there is no drafter."""
    if getattr(target_state, "hidden_layers", ()):
        target_state.hidden_layers, target_state.hidden = (), None
        target_state.share_kv, target_state.shared_kv = False, None
    return None


def _propose(drafter, generated, k, sampler, stats) -> Draft | None:
    if drafter is None:
        return Draft([])
    try:
        return drafter.propose(generated, k, sampler)
    except Exception as error:
        stats.fallback_reason = _reason(error, f"after {len(generated)} tokens")
        drafter.end()
        return None


def _reason(error: Exception, when: str) -> str:
    if isinstance(error, DrafterUnavailable):
        return str(error)
    return f"drafter failed {when}: {type(error).__name__}: {error}"


def _truncate(tokens: list[int], remaining: int, decode: DecodeSettings) -> list[int]:
    """Cut at max_new_tokens and after the first stop token."""
    tokens = tokens[:remaining]
    for i, token in enumerate(tokens):
        if token in decode.stop_token_ids:
            return tokens[: i + 1]
    return tokens


def _finished(generated: list[int], decode: DecodeSettings, stats: Stats, stop) -> bool:
    if generated[-1] in decode.stop_token_ids:
        stats.finish_reason = "stop_token"
    elif len(generated) >= decode.max_new_tokens:
        stats.finish_reason = "max_new_tokens"
    elif stop is not None and stop.is_set():
        stats.finish_reason = "stopped"
    return stats.finish_reason is not None


def _next_draft_length(k: int, num_drafted: int, num_accepted: int, decode: DecodeSettings) -> int:
    """Adaptive: +2 after a fully accepted draft, -1 after a rejection (at least 1)."""
    if not decode.adaptive or num_drafted == 0:
        return k
    if num_accepted == num_drafted:
        return min(k + 2, decode.max_draft_tokens)
    return max(k - 1, 1)


class TextStream:
    """Incremental detokenization: decode the whole answer, emit what is new; hold back an
    incomplete UTF-8 sequence (shown as U+FFFD) until its bytes arrive."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.emitted = ""

    def push(self, token_ids: list[int]) -> str:
        self.token_ids += token_ids
        text = self.full()
        if text.endswith("\ufffd"):
            return ""
        new, self.emitted = text[len(self.emitted):], text
        return new

    def full(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
