"""The project's own MTP head (models/drafter_heads.py: MtpHead) as a drafter, at the target's
own positions, M-RoPE included.

Serves: a `--drafter` folder or hub id whose config.json says model_type "mtp_head" (trained for
the bundled model by `python -m models.demo.train_drafters`). It must fit the target: same
hidden size and vocabulary (it uses the target's embedding table and output head).
Reads from the target: hidden state 0 (the merged input embeddings: image features at image
positions) and -1 (the last, normed).

Entry j of the head reads the embedding of token j + 1 and a hidden state of token j, sits at
the target's rotary position of token j + 1 (three M-RoPE rows in the prompt, i + rope_delta
after it, on every row) and predicts token j + 2. With committed tokens x_0 .. x_T (x_T is the
newest; the target has run x_0 .. x_{T-1}, so h_0 .. h_{T-1} are known), a round of k drafts:

    entries context_len .. T-1   embed x_{j+1}, read the target's h_j     -> d_1 from entry T-1
    entry T                      embeds d_1, reads entry T-1's output    -> d_2
    entry T + i - 2              embeds d_{i-1}, reads the entry before  -> d_i

One KV cache. Entries 0 .. T-1 read target hidden states and are never undone; the draft
entries T .. read the head's own outputs, so the next round first crops them (whatever was
accepted) and recomputes the accepted tokens' entries from the target's rows, which `accept`
hands over (the queue of target rows, `pending`, is engine/drafters/target_session.py's). Worked example: prompt of 10 tokens, first answer token x_10 from prefill. Round 1
runs entries 0 .. 9 (h_0 .. h_9 from prefill; entry 9 embeds x_10) and drafts d_1 .. d_4 with
entries 9, 10, 11, 12. The target verifies [x_10, d_1 .. d_4] and accepts 2: its rows for x_10,
d_1, d_2 are h_10 .. h_12, and x_13 is its bonus token. Round 2 crops the cache to 10 entries
and runs entries 10 .. 12 (embedding x_11 .. x_13), then drafts from entry 12.

Trees (`propose_tree`, engine/drafters/target_session.py's ChainedHeadSession, as EAGLE-3's):
a node at depth d embeds its token and reads its parent's output at the target's position of
T + d, seeing the context, its ancestors' entries and itself.

The head's steps run on the fast path (engine/fast_heads.py: the target's layer function over
a StaticKVCache) where it covers the head; `fast_fallback` says why not (heads from Qwen3.5
MTP weights).
"""

from __future__ import annotations

import os

import torch
from transformers import DynamicCache

from engine import fast_heads
from engine.drafters.base import Draft, DraftBuilder
from engine.drafters.target_head import TargetHead, load_module, module_dtype, require_hidden, weights_read
from engine.drafters.target_session import ChainedHeadSession, tokens_from
from engine.prompt import Prompt
from engine.runner import CacheState, TargetReads
from engine.sampling import Sampler
from models import drafter_heads
from models.drafter_heads import MtpHeadConfig, causal_mask
from models.loading import LoadError

READS = (0, -1)  # merged input embeddings, last hidden state


def serves(name: str, config) -> bool:
    return getattr(config, "model_type", None) == MtpHeadConfig.model_type


def load(name: str, config, target, options) -> MtpHeadDrafter:
    module = load_module(name, config, target, options)
    return MtpHeadDrafter(name, module, TargetHead.of(target, module), target.family)


def load_qwen3_5(name: str, target, options) -> MtpHeadDrafter:
    """`--drafter mtp` for a Qwen3.5 / 3.6 target: transformers 5.24 builds no module for the
    `mtp.*` weights of its checkpoint, so they become this head (models/drafter_heads.py), read
    from the target's folder (or its hub snapshot)."""
    folder = target.name
    if not os.path.isdir(folder):
        from huggingface_hub import snapshot_download

        folder = snapshot_download(folder, allow_patterns=["*.json", "*.safetensors"])
    try:
        module = drafter_heads.mtp_head_from_qwen3_5(folder)
    except (OSError, RuntimeError, ValueError) as error:  # no mtp.* weights, or missing / mis-shaped ones
        raise LoadError(f"--drafter mtp: cannot read the MTP layers of {target.name!r}: "
                        f"{' '.join(str(error).split())}") from error
    module = module.to(device=target.model.device,
                       dtype=module_dtype(target, options, weights_read(module, target))).eval()
    return MtpHeadDrafter(name, module, TargetHead.of(target, module), target.family)


class MtpHeadDrafter:
    kind = "mtp"
    reads = TargetReads(hidden_layers=READS)

    def __init__(self, name: str, module, head: TargetHead, family, fast: bool = True):
        self.name, self.module, self.head, self.family = name, module, head, family
        self.fast_fallback = fast_heads.unsupported(module) if fast else "turned off"  # None: fast path
        self.fast = fast_heads.FastMtpHead(module) if self.fast_fallback is None else None

    @torch.inference_mode()
    def begin(self, prompt: Prompt, target: CacheState) -> MtpHeadSession:
        require_hidden(self.name, target, READS)
        return MtpHeadSession(self, prompt, target)


class MtpHeadSession(ChainedHeadSession):
    def __init__(self, drafter: MtpHeadDrafter, prompt: Prompt, target: CacheState):
        # pending: (m, H) target rows h_j of entries context_len .. context_len + m - 1
        super().__init__(drafter.family, target, (-1,))
        self.forward, self.head = drafter.fast or drafter.module, drafter.head
        self.prompt_ids = prompt.input_ids
        self.prompt_embeds = target.hidden[0].to(self.head.dtype)  # (S, H)
        self.cache = drafter.fast.new_cache(len(self.prompt_ids)) if drafter.fast else DynamicCache()
        self.context_len = 0  # entries that read target hidden states (0 .. context_len - 1)

    @torch.inference_mode()
    def propose(self, generated: list[int], k: int, sampler: Sampler) -> Draft:
        if k <= 0:
            return Draft([])
        out = self._context(generated)  # (1, H) the newest context entry's
        builder = DraftBuilder(sampler)
        token = builder.sample(self.head.logits(out)[0])
        for entry in range(self.context_len, self.context_len + k - 1):
            out = self._run(self.head.embed([token]), out, entry)
            token = builder.sample(self.head.logits(out)[0])
        return builder.draft()

    def _context(self, generated: list[int]) -> torch.Tensor:
        """Drop last round's draft entries, run the entries of the committed tokens not yet run
        (the target's rows in `pending`); (1, H) the newest one's output, which drafts d_1."""
        newest = len(self.prompt_ids) + len(generated) - 1  # T: x_0 .. x_T are committed
        self.cache.crop(self.context_len - self.cache.get_seq_length())  # last round's draft entries
        first = self.context_len
        token_ids = tokens_from(self.prompt_ids, generated, first + 1)  # x_{first+1} .. x_T
        out = self._run(self.embeds(first + 1, token_ids), self.take_pending(), first)  # entries first .. T-1
        self.context_len = newest
        return out[-1:]

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.head.logits(out)

    def _tree_entries(self, token_ids: list[int], parent_out: torch.Tensor, level: int, seen: torch.Tensor) -> torch.Tensor:
        """Nodes at depth level + 1: their tokens' embeddings and their parents' outputs, at the
        target's position of token T + level + 1, each seeing `seen` (n, cached + n)."""
        positions = self.positions(self.context_len + level + 1, self.context_len + level + 2)
        positions = positions.expand(*positions.shape[:-1], len(token_ids))
        mask = seen.to(parent_out.device)[None, None]
        return self.forward(self.head.embed(token_ids)[None], parent_out[None].to(self.head.dtype), positions, mask,
                            self.cache)[0]

    def _run(self, embeds: torch.Tensor, hidden: torch.Tensor, first: int) -> torch.Tensor:
        """Entries first .. first + n - 1 (embeds, hidden (n, H)), appended to the cache; (n, H) outputs."""
        n, cached = len(embeds), self.cache.get_seq_length()
        positions = self.positions(first + 1, first + 1 + n)
        mask = causal_mask(n, cached, embeds.device) if n > 1 else None
        return self.forward(embeds[None], hidden[None].to(self.head.dtype), positions, mask, self.cache)[0]

    def embed_tokens(self, token_ids: list[int]) -> torch.Tensor:
        return self.head.embed(token_ids)
