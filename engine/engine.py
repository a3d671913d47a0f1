"""The engine: a loaded target, its drafters, and one generation at a time.

    engine = build_engine(EngineSpec(...))        # engine/build.py, or Engine(target, drafters)
    for event in engine.stream(messages, drafter="text"):
        ...  # Chunk events, then one Done; each carries a snapshot of the statistics

`stream` queues the request on the engine's worker thread (engine/worker.py), which steps up to
`running_requests` answers (`_steps`) together in rounds under the engine's lock, each round's
target passes in one shared pass; the caller holds nothing between events, so one that walks away
(closes the stream, drops it, or just stops reading) never blocks the others. The app reaches it
through the backend interface (engine/backend.py).

All per-request state (KV caches, positions, the drafter's session, the sampler's generator) is
created inside `_steps` and dropped when it ends, so requests cannot see each other's state;
the loaded target and drafters hold none. The lock keeps one thread computing, because the
models share one device and one set of threads.
"""

from __future__ import annotations

import copy
import inspect
import threading
import time
from dataclasses import replace
from collections.abc import Iterator

import torch

from engine.auto import DrafterChooser
from engine.draft_length import PassCosts
from engine.drafters.base import Drafter
from engine.loop import Chunk, DecodeSettings, Done, PassRequest, RequestInfo, answer, drive
from engine.images import fit_to_processor
from engine.load_settings import LoadSettings
from engine.prompt import Prompt, encode_vlm, images_of, neutralize, normalize
from engine.sampling import SamplingSettings
# Ceilings, check_ceilings and ceiling_variable are the schema's (engine/settings.py), imported here by the app
from engine.settings import Ceilings, RequestError, ceiling_variable, check_ceilings, check_text, check_value  # noqa: F401
from engine.stats import Stats
from engine.target import Target
from engine.worker import Stream, Worker


AUTO = "auto"  # the drafter name that picks one per request
RUNNING_REQUESTS = LoadSettings.running_requests  # the default of the most answers decoded together


class ContextError(RequestError):
    """The prompt does not fit the model's context."""


class Engine:
    def __init__(self, target: Target, drafters: dict[str, Drafter] | None = None, max_images: int = 8,
                 max_image_tokens: int | None = None, auto: bool = False, running_requests: int = RUNNING_REQUESTS):
        self.target = target
        self.drafters = dict(drafters or {})
        self.max_images = max_images
        self.max_image_tokens = max_image_tokens  # default budget of tokens per image; None: the processor's own
        self.auto = auto and bool(self.drafters)  # the default drafter is "auto" (engine/auto.py)
        self.running_requests = running_requests  # the most answers the worker decodes together; more wait in line
        self.lock = threading.Lock()  # one thread computing: held by the worker thread alone (engine/worker.py)
        # Callers prepare prompts (`prepare`) while an answer runs: with their own copy of the
        # processor (fast tokenizers raise "Already borrowed" when two threads use one), one at a time.
        self.prepare_lock = threading.Lock()
        self.prepare_processor = copy.deepcopy(target.processor)
        self.costs = PassCosts()  # measured pass costs: the draft length (engine/draft_length.py)
        self.chooser = DrafterChooser(list(self.drafters))  # what each drafter delivered: "auto"
        self.worker = Worker(self)  # serves concurrent callers, their answers stepped together (engine/worker.py)

    @property
    def default_drafter(self) -> str | None:
        return AUTO if self.auto else next(iter(self.drafters), None)

    def stop_token_ids(self) -> frozenset[int]:
        ids = set()
        for source in (self.target.model.generation_config, self.target.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        return frozenset(i for i in ids if i is not None)

    def context_limit(self) -> int | None:
        return getattr(self.target.model.config.get_text_config(), "max_position_embeddings", None)

    def prepare(self, messages: list[dict], max_image_tokens: int | None = None) -> Prompt:
        """The conversation made ready for the target: text checked and its markup neutralized,
        images shrunk to the processor's size, then rendered, tokenized and processed, each image
        at most about `max_image_tokens` tokens (None: the engine's default; 0: the processor's own
        limit). Raises RequestError (ContextError when the prompt does not fit the context).
        Never waits for a running answer: it has a processor of its own (`prepare_processor`)."""
        with self.prepare_lock:
            return self._prepare(messages, max_image_tokens)

    def _prepare(self, messages: list[dict], max_image_tokens: int | None = None) -> Prompt:
        budget = self.max_image_tokens if max_image_tokens is None else (max_image_tokens or None)
        messages = normalize(messages)
        limit = self.context_limit()
        for message in messages:
            for part in message["content"]:
                if part["type"] == "text":
                    check_text(part["text"], limit)
        processor = self.prepare_processor
        messages = fit_images(neutralize(messages, self.target.tokenizer), processor, self.target.family)
        images = images_of(messages)
        if len(images) > self.max_images:
            raise RequestError(f"{len(images)} images in the conversation; the limit is {self.max_images}")
        try:
            inputs = encode_vlm(processor, self.target.family, messages, budget)
        except ValueError as error:  # e.g. Qwen's processor refuses an aspect ratio over 200:1
            raise RequestError(f"the model's processor cannot prepare this message: {error}") from None
        prompt = Prompt(messages, images, inputs, self.target.placeholder_ids, budget)
        if limit and len(prompt.input_ids) >= limit:
            raise ContextError(f"the prompt is {len(prompt.input_ids)} tokens ({prompt.num_image_tokens} of them for "
                               f"images); the model's context is {limit}: send fewer or smaller images or a shorter "
                               "message")
        return prompt

    def stream(self, *args, **kwargs) -> Stream:
        """Answer a request (`_run`'s arguments, its events) on the worker thread: the caller holds
        nothing between events; closing or dropping the stream stops the request. The only way in."""
        request = inspect.signature(self._steps).bind(*args, **kwargs).arguments
        return self.worker.submit(request.pop("messages"), **request)

    def _run(self, *args, **kwargs) -> Iterator[Chunk | Done]:
        """`_steps`'s events (its arguments), each of its target passes run at once, alone (loop.drive)."""
        return drive(self._steps(*args, **kwargs))

    def _steps(
        self,
        messages: list[dict] | Prompt,
        drafter: str | None = None,
        sampling: SamplingSettings = SamplingSettings(),
        decode: DecodeSettings = DecodeSettings(),
        stop: threading.Event | None = None,
        started: float | None = None,
        max_image_tokens: int | None = None,
    ) -> Iterator[Chunk | Done | PassRequest]:
        """Answer the conversation's last user turn (messages, or a Prompt from `prepare`).
        drafter=None decodes plainly; "auto" picks one of the loaded drafters by what each has
        delivered (engine/auto.py). `started`: the request's start (time.perf_counter()),
        default now; `ttft_s` and `total_s` count from it, so image and prompt processing
        are included (`prepare_s`). A request stopped before it starts ends at once, with no
        answer; an answer that fills the context ends with finish_reason "context".
        Yields the events and each target pass the answer needs (loop.answer: its logits, or the pass's
        exception, sent back). The worker thread's alone (engine/worker.py), which holds the engine's lock
        around each round; every caller uses `stream`."""
        started = time.perf_counter() if started is None else started
        if drafter is not None and drafter not in self.drafters and not (drafter == AUTO and self.drafters):
            raise RequestError(f"unknown drafter {drafter!r}; loaded: {', '.join(self.drafters) or 'none'}")
        sampling, decode = checked_settings(sampling, decode)
        if stop is not None and stop.is_set():
            yield self.stopped(drafter)
            return
        prompt = messages if isinstance(messages, Prompt) else self.prepare(messages, max_image_tokens)
        auto_choice = None
        if drafter == AUTO:
            drafter, auto_choice = self.chooser.choose(len(prompt.images))
        if not decode.stop_token_ids:
            decode = replace(decode, stop_token_ids=self.stop_token_ids())
        room = self.context_limit() - len(prompt.input_ids) if self.context_limit() else None
        context_cut = room is not None and decode.max_new_tokens >= room
        if context_cut:  # the answer must fit the context too
            decode = replace(decode, max_new_tokens=room)
        try:
            steps = answer(self.target.runner_for(len(prompt.images)), self.target.tokenizer, prompt,
                           self.drafters.get(drafter) if drafter else None, sampling, decode, stop, self.costs,
                           RequestInfo(started, context_cut, auto_choice))
            event = next(steps)
            while True:  # the loop's events and passes out, each pass's logits back in (None after an event)
                if isinstance(event, Done) and drafter:
                    self.chooser.record(drafter, len(prompt.images), event.stats.decode_tokens,
                                        event.stats.decode_tok_s)
                reply = yield event
                try:
                    event = steps.send(reply)
                except StopIteration:
                    return
        except torch.OutOfMemoryError:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # this request's caches are gone; the next one starts clean
            raise RequestError("out of memory while answering; try fewer or smaller images, a shorter "
                               "conversation or fewer new tokens") from None

    def stopped(self, drafter: str | None) -> Done:
        """The answer of a request stopped before it started: empty, finish_reason "stopped"."""
        name = self.drafters[drafter].name if drafter in self.drafters else drafter
        return Done("", [], Stats(mode="speculative" if drafter else "plain", finish_reason="stopped", drafter=name))


MIN_TEMPERATURE = 1e-3  # below it sampling is greedy in effect, and logits / T can overflow: decode greedily


def fit_images(messages: list[dict], processor, family) -> list[dict]:
    """Normalized `messages` with every image shrunk to what `processor` (of `family`) uses
    (fit_to_processor: unchanged when already that small)."""
    return [{"role": m["role"], "content": [
        {**part, "image": fit_to_processor(part["image"], processor, family)} if part["type"] == "image" else part
        for part in m["content"]]} for m in messages]


def checked_settings(sampling: SamplingSettings, decode: DecodeSettings) -> tuple[SamplingSettings, DecodeSettings]:
    """The settings, or RequestError naming the first one out of its range (engine/settings.py);
    a temperature under MIN_TEMPERATURE decodes greedily."""
    for name, value in [("temperature", sampling.temperature), ("top_p", sampling.top_p), ("top_k", sampling.top_k),
                        ("seed", sampling.seed), ("max_new_tokens", decode.max_new_tokens),
                        ("draft_tokens", decode.draft_tokens), ("draft_tree", decode.draft_tree),
                        ("tree_branching", decode.tree_branching)]:
        check_value(name, value)  # seed None: a random seed; draft_tokens None: chosen from cost
    if decode.draft_tokens == 0:  # as in the schema: 0 is chosen from cost
        decode = replace(decode, draft_tokens=None)
    if 0 < sampling.temperature < MIN_TEMPERATURE:
        sampling = replace(sampling, temperature=0.0)
    return sampling, decode
