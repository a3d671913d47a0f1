"""The engine: a loaded target, its drafters, and one generation at a time.

    engine = build_engine(EngineSpec(...))        # engine/build.py, or Engine(target, drafters)
    for event in engine.stream(messages, drafter="text"):
        ...  # Chunk events, then one Done with the statistics

All per-request state (KV caches, positions, the drafter's session, the sampler's generator) is
created inside `stream` and dropped when it ends, so requests cannot see each other's state;
the loaded target and drafters hold none. The lock runs one generation at a time, because the
models share one device and one set of threads.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from collections.abc import Iterator

import torch

from engine.auto import DrafterChooser
from engine.draft_length import PassCosts
from engine.drafters.base import Drafter
from engine.loop import Chunk, DecodeSettings, Done, generate
from engine.prompt import Prompt, encode_vlm, images_of, normalize
from engine.sampling import SamplingSettings
from engine.target import Target


AUTO = "auto"  # the drafter name that picks one per request


class RequestError(ValueError):
    """The request cannot be answered as sent (too many images, too long...); says why."""


class Engine:
    def __init__(self, target: Target, drafters: dict[str, Drafter] | None = None, max_images: int = 8,
                 auto: bool = False):
        self.target = target
        self.drafters = dict(drafters or {})
        self.max_images = max_images
        self.auto = auto and bool(self.drafters)  # the default drafter is "auto" (engine/auto.py)
        self.lock = threading.Lock()  # one generation per loaded model at a time
        self.costs = PassCosts()  # measured pass costs: the draft length (engine/draft_length.py)
        self.chooser = DrafterChooser(list(self.drafters))  # what each drafter delivered: "auto"

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

    def prepare(self, messages: list[dict]) -> Prompt:
        messages = normalize(messages)
        images = images_of(messages)
        if len(images) > self.max_images:
            raise RequestError(f"{len(images)} images in the conversation; the limit is {self.max_images}")
        try:
            inputs = encode_vlm(self.target.processor, messages)
        except ValueError as error:  # e.g. Qwen's processor refuses an aspect ratio over 200:1
            raise RequestError(f"the model's processor cannot prepare this message: {error}") from None
        prompt = Prompt(messages, images, inputs, self.target.placeholder_ids)
        limit = self.context_limit()
        if limit and len(prompt.input_ids) >= limit:
            raise RequestError(f"the prompt is {len(prompt.input_ids)} tokens ({prompt.num_image_tokens} of them for "
                               f"images); the model's context is {limit}: send fewer or smaller images or a shorter "
                               "message, or start a new chat")
        return prompt

    def stream(
        self,
        messages: list[dict],
        drafter: str | None = None,
        sampling: SamplingSettings = SamplingSettings(),
        decode: DecodeSettings = DecodeSettings(),
        stop: threading.Event | None = None,
    ) -> Iterator[Chunk | Done]:
        """Answer the conversation's last user turn. drafter=None decodes plainly; "auto" picks
        one of the loaded drafters by what each has delivered (engine/auto.py)."""
        if drafter is not None and drafter not in self.drafters and not (drafter == AUTO and self.drafters):
            raise RequestError(f"unknown drafter {drafter!r}; loaded: {', '.join(self.drafters) or 'none'}")
        prompt = self.prepare(messages)
        auto_choice = None
        if drafter == AUTO:
            drafter, auto_choice = self.chooser.choose(len(prompt.images))
        if not decode.stop_token_ids:
            decode = replace(decode, stop_token_ids=self.stop_token_ids())
        room = self.context_limit() - len(prompt.input_ids) if self.context_limit() else None
        if room is not None and decode.max_new_tokens > room:  # the answer must fit the context too
            decode = replace(decode, max_new_tokens=room)
        with self.lock:
            try:
                for event in generate(self.target.runner, self.target.tokenizer, prompt,
                                      self.drafters.get(drafter) if drafter else None, sampling, decode, stop,
                                      self.costs):
                    event.stats.auto_choice = auto_choice
                    if isinstance(event, Done) and drafter:
                        self.chooser.record(drafter, len(prompt.images), event.stats.decode_tokens,
                                            event.stats.decode_tok_s)
                    yield event
            except torch.OutOfMemoryError:
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # this request's caches are gone; the next one starts clean
                raise RequestError("out of memory while answering; try fewer or smaller images, a shorter "
                                   "conversation or fewer new tokens") from None
