"""The one interface every drafter shares, in the style of llama.cpp's begin / draft / accept.

Lifecycle of one request:
    drafter.begin(prompt)                        # prefill on the request's prompt
    loop:
        draft = drafter.propose(generated, k, sampler)   # up to k tokens after generated[-1]
        ... the target verifies ...
        drafter.accept(num_accepted)             # how many of the draft the target kept
    drafter.end()                                # drop per-request state

`generated` is the whole answer so far (committed tokens only). An empty draft is a valid
answer: the loop then decodes one token plainly. A drafter that cannot serve a request raises
`DrafterUnavailable(reason)` from `begin`; any exception from a drafter hands the rest of the
request to plain decoding, with the reason recorded in the statistics.

Drafters that read the target (MTP heads, DFlash block drafters, shared-cache assistants) name
the target's hidden states they need in `target_layers` (as `output_hidden_states` indexes
them: 0 = the merged input embeddings, image features included; -1 = the last, normed). The
target then keeps those states of every pass in its CacheState (`hidden`, one (n, H) per
layer, for the n positions the pass ran), and the loop calls `begin(prompt, target_state)`:
after prefill `target_state.hidden` covers the prompt; in `accept(num_accepted)` it covers the
verify pass, whose first num_accepted + 1 rows are committed (the last committed token and the
accepted draft tokens). A drafter that also attends to the target's K/V (Gemma 4's assistant)
sets `shares_kv = True`: each pass then also keeps `target_state.shared_kv`. Other drafters
never make the target compute any of this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.prompt import Prompt
from engine.sampling import Sampler


class DrafterUnavailable(Exception):
    """The drafter has no usable context for this request; the request decodes plainly."""


@dataclass
class Draft:
    token_ids: list[int]  # (k,)
    probs: torch.Tensor | None = None  # (k, V) the distributions sampled from; None = deterministic


class Drafter(Protocol):
    name: str  # what the user picked: a model id or folder, or "ngram"
    kind: str  # "text_lm", "vlm", "ngram", "mtp", "dflash", "shared_cache"
    # optional: target_layers: tuple[int, ...]  -- hidden states read from the target (see above)
    # optional: shares_kv: bool  -- also reads the K/V of the target's KV-sharing layers

    def begin(self, prompt: Prompt) -> None: ...

    def propose(self, generated: list[int], k: int, sampler: Sampler) -> Draft: ...

    def accept(self, num_accepted: int) -> None: ...

    def end(self) -> None: ...
