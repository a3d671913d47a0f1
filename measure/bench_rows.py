"""One benchmark measurement per (row, request): this engine's stream, or transformers' generate().

Both are timed the same way: the clock starts before prompt processing, the first token's
time is when it is available to the consumer (a streamer for generate()), and the device is
synchronized before each reading.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from engine import tree
from engine.loop import DecodeSettings, Done
from engine.sampling import Sampler, SamplingSettings, accept_tree
from engine.stats import Clock


@dataclass
class Measurement:
    request: int
    token_ids: list[int] = field(default_factory=list)
    first_token_s: float = 0.0
    answer_s: float = 0.0
    decode_tok_s: float = 0.0
    tokens_per_forward: float | None = None
    drafted: int = 0
    accepted: int = 0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    rejected_rounds: int = 0
    drafter_used: str | None = None  # with drafter "auto": the one it picked
    error: str | None = None
    tree_fallback: str | None = None  # why a tree row drafted chains


def run_this(engine, drafter: str | None, messages, decode: DecodeSettings, request_id: int) -> Measurement:
    done = [e for e in engine.stream(messages, drafter=drafter, decode=decode) if isinstance(e, Done)][0]
    s = done.stats
    return Measurement(request_id, done.token_ids, s.ttft_s, s.total_s, s.decode_tok_s,
                       s.tokens_per_forward if drafter else None, s.drafted, s.accepted,
                       s.drafted_by_position, s.accepted_by_position, s.draft_lengths if drafter else [],
                       s.rejected_rounds, s.drafter, tree_fallback=s.tree_fallback)


class _TimingStreamer:
    """generate() calls put() with the prompt first, then with each new token."""

    def __init__(self, clock: Clock):
        self.clock, self.calls, self.first_token_at = clock, 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            self.first_token_at = self.clock.now()

    def end(self):
        pass


def run_transformers(engine, drafter: str | None, messages, decode: DecodeSettings, request_id: int) -> Measurement:
    """transformers' generate(): plain, with `assistant_model` (a drafter that is its own model),
    or with prompt lookup (drafter "prompt_lookup")."""
    target = engine.target
    clock = Clock(target.runner.device)
    started = clock.now()
    streamer = _TimingStreamer(clock)
    kwargs = {"max_new_tokens": decode.max_new_tokens, "do_sample": False, "streamer": streamer,
              "eos_token_id": sorted(engine.stop_token_ids()), "pad_token_id": target.tokenizer.pad_token_id}
    try:
        if drafter == "prompt_lookup":
            kwargs["prompt_lookup_num_tokens"] = decode.draft_tokens or 4  # generate() has no cost-chosen k
        elif drafter is not None:
            assistant = engine.drafters[drafter].runner.model
            assistant.generation_config.num_assistant_tokens = decode.draft_tokens or 4
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            kwargs["assistant_model"] = assistant
        prompt = engine.prepare(messages)
        inputs = {k: v.to(target.runner.device) for k, v in prompt.target_inputs.items()}
        with torch.inference_mode():  # the weights the engine answers this conversation with (picture weights)
            out = target.model_for(len(prompt.images)).generate(**inputs, **kwargs)
    except Exception as error:  # a crash is a result: the row reports it
        return Measurement(request_id, error=f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")
    finished = clock.now()
    token_ids = out[0, inputs["input_ids"].shape[1]:].tolist()
    first = streamer.first_token_at or finished
    decode_tokens = len(token_ids) - 1
    return Measurement(request_id, token_ids, first - started, finished - started,
                       decode_tokens / (finished - first) if finished > first else 0.0)


def median_seconds(fn, clock: Clock, repeats: int, skip: int = 0) -> float:
    """Median seconds of `repeats` calls of fn(), the first `skip` left out (warm-up)."""
    times = []
    for _ in range(repeats):
        started = clock.now()
        fn()
        times.append(clock.now() - started)
    return statistics.median(times[skip:])


def cost_model(engine, messages, k: int, repeats: int = 7, max_tokens: int = 9, draft_tree: int = 0,
               branching: int = 2) -> dict:
    """Median cost of one target forward over n = 1..max_tokens tokens after this prompt
    (`t_s`; `forward_1_s` = t(1), `verify_s` = t(k+1)), and of one
    draft step of each drafter: a `propose` of k tokens divided by the tokens it drafted, timed
    in greedy decode rounds that follow the drafter contract (prefill with the drafter's reads,
    begin, then propose / verify / accept / roll back), so every kind of drafter is measured.
    With draft_tree, also a tree verify pass over draft_tree + 1 tokens (`verify_tree_s`) and a
    whole `propose_tree` of each drafter that can branch (`draft_tree_s`)."""
    target = engine.target.runner
    prompt = engine.prepare(messages)
    clock = Clock(target.device)

    def timed(fn) -> float:
        return median_seconds(fn, clock, repeats, skip=1)

    _, state = target.prefill(prompt.target_inputs)
    token = prompt.input_ids[-1]

    def extend_and_undo(n):
        target.checkpoint(state)  # a hybrid target (Qwen3.5) rolls back to here
        target.extend(state, [token] * n)
        target.rollback(state, n)

    def tree_and_undo(n):  # a binary tree of n nodes under the last token
        target.extend_tree(state, [token] * (n + 1), [-1] + [i // 2 for i in range(n)])
        target.keep_path(state, [0])
        target.rollback(state, 1)

    t_s = {n: timed(lambda n=n: extend_and_undo(n)) for n in range(1, max(max_tokens, k + 1) + 1)}
    costs = {"forward_1_s": t_s[1], "verify_s": t_s[k + 1], "t_s": t_s, "draft_step_s": {}}
    for key, drafter in engine.drafters.items():
        costs["draft_step_s"][key] = _draft_cost(target, drafter, prompt, k, repeats, clock)
    if draft_tree and target.tree_unsupported(state) is None:
        costs["verify_tree_s"] = timed(lambda: tree_and_undo(draft_tree))
        tree_costs = {key: _draft_cost(target, drafter, prompt, k, repeats, clock, draft_tree, branching)
                      for key, drafter in engine.drafters.items()}
        costs["draft_tree_s"] = {key: cost for key, cost in tree_costs.items() if cost is not None}
    return costs


def _draft_cost(target, drafter, prompt, k: int, repeats: int, clock: Clock, draft_tree: int = 0,
                branching: int = 2) -> float | None:
    """A chain's draft step (a propose divided by the tokens it drafted), or a whole tree's
    propose_tree (with draft_tree; None for a drafter that drafts chains only)."""
    sampler = Sampler(SamplingSettings())
    logits, state = target.prefill(prompt.target_inputs, drafter.reads)
    session = drafter.begin(prompt, state)
    if draft_tree and not hasattr(session, "propose_tree"):
        return None
    generated, times = [int(logits.argmax())], []
    for _ in range(repeats):
        t0 = clock.now()
        if draft_tree:
            draft = session.propose_tree(generated, k, draft_tree, branching, sampler)
        else:
            draft = session.propose(generated, k, sampler)
        times.append((clock.now() - t0) / (1 if draft_tree else max(1, len(draft.token_ids))))
        verify_logits = tree.verify(target, state, generated[-1], draft)
        path, bonus_token = accept_tree(sampler, draft.token_ids, draft.parents, None, verify_logits)
        tree.keep(target, state, draft, path)
        session.accept(len(path)) if draft.parents is None else session.accept(len(path), path)
        generated += [draft.token_ids[node] for node in path] + [bonus_token]
    return statistics.median(times[1:])


def interleaved(rounds: int, sides, measure) -> dict:
    """{side: [measure(round_index, side) for each round]}, the sides taking turns within each round,
    so that a drift of the machine (heat, another process) falls on every side alike."""
    results = {side: [] for side in sides}
    for round_index in range(rounds):
        for side in sides:
            results[side].append(measure(round_index, side))
    return results
