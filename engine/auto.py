"""`--drafter auto`: pick, per request, the loaded drafter that has delivered the most.

Every speculative request of at least MIN_TOKENS decode tokens (whoever chose its drafter: a
user, the API, or this chooser) records its decode tokens per second under its drafter and its
image count, in contexts of 0, 1, 2 and 3 or more images (images make prompts longer, and
what a drafter that cannot see them is worth differs: engine/acceptance.py `image_context`).
A request asking for "auto" gets, in
this order:
1. a drafter with no record in the request's context (each is tried once per context);
2. every EXPLORE_EVERY-th auto request, the drafter whose latest record is oldest (drafters
   and requests change: a drafter that lost once is looked at again);
3. otherwise the drafter with the highest mean tok/s over its last WINDOW records in the
   request's context.
The records are the engine's, so every visitor's requests count: the reason (the figures
compared, from the server's latest speculative answers, any visitor's) says so, without counts; it goes into
the request's statistics as `auto_choice`.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from engine.acceptance import image_context

MIN_TOKENS = 8
WINDOW = 8
EXPLORE_EVERY = 10


@dataclass(frozen=True)
class Record:
    serial: int  # the request's number on this engine
    num_images: int
    tok_s: float


class DrafterChooser:
    def __init__(self, names: list[str]):
        self.names = list(names)
        self.records: dict[str, dict[int, deque[Record]]] = {name: {} for name in self.names}  # by context
        self.serial = 0  # requests recorded
        self.auto_requests = 0

    def record(self, name: str, num_images: int, decode_tokens: int, decode_tok_s: float) -> None:
        self.serial += 1
        if name in self.records and decode_tokens >= MIN_TOKENS:
            self.records[name].setdefault(image_context(num_images), deque(maxlen=WINDOW)).append(
                Record(self.serial, num_images, decode_tok_s))

    def choose(self, num_images: int) -> tuple[str, str]:
        """(drafter key, why) for a request with `num_images` images."""
        self.auto_requests += 1
        context = image_context(num_images)
        untried = [name for name in self.names if not self.records[name].get(context)]
        if untried:
            return untried[0], f"auto: {untried[0]} (exploring: no measured request {_scope(context)} on this server yet)"
        if self.auto_requests % EXPLORE_EVERY == 0:
            name = min(self.names, key=lambda n: self.records[n][context][-1].serial)
            return name, (f"auto: {name} (exploring, every {EXPLORE_EVERY}th request: the drafter longest unmeasured "
                          f"{_scope(context)})")
        # The reason is shown to the visitor: speeds only, never how many requests the server has
        # answered (other visitors' activity).
        scores = {name: [r.tok_s for r in self.records[name][context]] for name in self.names}
        best = max(self.names, key=lambda n: statistics.mean(scores[n]))
        figures = ", ".join(f"{name} {statistics.mean(speeds):.1f} tok/s"
                            for name, speeds in sorted(scores.items(), key=lambda s: -statistics.mean(s[1])))
        return best, (f"auto: {best} (recent decode speed {_scope(context)}, measured over this server's latest "
                      f"speculative answers, any visitor's: {figures})")  # no counts: they would tell a visitor the traffic


def _scope(context: int) -> str:
    return {0: "without images", 1: "with 1 image", 2: "with 2 images"}.get(context, "with 3 or more images")
