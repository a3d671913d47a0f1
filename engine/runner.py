"""One model's forward passes over a per-request KV cache, with explicit positions.

Used for the target and for every drafter that is itself a language model. The cache is
indexed by KV slot; the rotary position is tracked separately because after an image on an
M-RoPE model the two differ by `rope_delta`. Rolling back a rejected draft is one `crop`.

Decode and verify passes of models whose text stack engine/fast_decode.py covers run its
hand-written forward over a preallocated cache (engine/static_cache.py): prefill runs
transformers' forward, and its cache is copied into the static one. Other models keep
transformers' forward and its DynamicCache; `Runner.fast_fallback` says why.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

from engine import fast_decode
from engine.static_cache import StaticKVCache
from engine.tree import MAX_VERIFY_ROWS, Pass, ancestor_mask, tree_depths
from models.families import Family


@dataclass(frozen=True)
class TargetReads:
    """What a drafter reads from every pass of the target (none for text, VLM and n-gram drafters).

    hidden_layers: hidden states, indexed as `output_hidden_states` indexes them: 0 = the merged
                   input embeddings (image features included), i = output of layer i, -1 = the
                   last, normed.
    shared_kv:     the K/V the target's KV-sharing layers store (Gemma 4), for an assistant that
                   attends to them.
    """

    hidden_layers: tuple[int, ...] = ()
    shared_kv: bool = False

    def __bool__(self) -> bool:
        return bool(self.hidden_layers) or self.shared_kv


NO_READS = TargetReads()


@dataclass
class CacheState:
    """The KV cache of one model for one request.

    cache_len: tokens held in the KV cache (the KV index of the next token).
    rope_pos:  rotary position of the next token; cache_len + rope_delta.
    prompt_positions: the prompt's position ids, (1, S) or (3, 1, S) on M-RoPE models, as the
               prefill used them; kept for drafters that run at the target's positions.
    rope_delta: rope_pos - cache_len after the prompt (negative after an image on M-RoPE).
    reads:     what each pass also returns for a drafter that reads the target (TargetReads):
    hidden:    {layer: (n, H)} the asked hidden states for the n positions the last pass ran
               (after a tree pass's `keep_path`: for the kept path's entries, in order);
    shared_kv: {layer type: (K, V)} as the model returns them (the cache's entries before the
               pass, then the pass's own).
    tree_parents: a draft tree held after the cache_len committed entries, not yet settled
               (`Runner.extend_tree`, then `keep_path`): the parent of each tree entry, an index
               into this list, -1 for a child of the committed sequence (engine/tree.py).
    """

    cache: DynamicCache | StaticKVCache
    cache_len: int
    rope_pos: int
    prompt_positions: torch.Tensor | None = None
    rope_delta: int = 0
    reads: TargetReads = NO_READS
    hidden: dict[int, torch.Tensor] | None = None
    shared_kv: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    tree_parents: list[int] = field(default_factory=list)

    def stop_reading(self) -> None:
        """After a drafter's fallback: later passes compute nothing for a drafter."""
        self.reads, self.hidden, self.shared_kv = NO_READS, None, None


@dataclass
class PassPart:
    """One request's rows in a fast pass (engine/fast_decode.py FastDecoder.forward): token_ids (n,) at
    rotary `positions` (n,) (or a range of them) after `cache`'s entries, under attention_mask (None:
    causal over the new rows, or an additive (n, length + n) one, a draft tree's), keeping the rows of
    `hidden_layers`."""

    cache: StaticKVCache
    token_ids: list[int]
    positions: torch.Tensor | range
    attention_mask: torch.Tensor | None = None
    hidden_layers: tuple[int, ...] = ()


PREFILL_CHUNK = 512  # a longer prompt is read in passes of this many tokens, Stop looked at between them
PER_TOKEN_INPUTS = ("input_ids", "token_type_ids", "mm_token_type_ids")  # processor outputs with a row per token
IMAGE_TOKEN_FIELDS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")


def prefill_bounds(inputs: dict[str, torch.Tensor], image_token_ids: set[int], reads: TargetReads) -> list[tuple[int, int]]:
    """The passes a prompt is read in, as (start, end) token ranges: one pass up to PREFILL_CHUNK
    tokens; a longer prompt in passes of PREFILL_CHUNK, the first reaching past its last image
    token (the image features enter with the first pass). In one pass when splitting is not known
    to be sound: image inputs without a placeholder id the config names, an attention mask that
    masks a token, or a drafter that reads the shared K/V (each pass would return only its own)."""
    input_ids = inputs["input_ids"][0]
    seq_len = len(input_ids)
    mask = inputs.get("attention_mask")
    images = [i for i, token in enumerate(input_ids.tolist()) if token in image_token_ids]
    has_pixels = any(name not in PER_TOKEN_INPUTS + ("attention_mask",) for name in inputs)
    if seq_len <= PREFILL_CHUNK or reads.shared_kv or (mask is not None and not bool(mask.all())) \
            or (has_pixels and not images):
        return [(0, seq_len)]
    starts = list(range(max(PREFILL_CHUNK, images[-1] + 1 if images else 0), seq_len, PREFILL_CHUNK))
    ends = starts + [seq_len]
    return list(zip([0] + starts, ends))


def _prompt_part(inputs: dict[str, torch.Tensor], start: int, end: int) -> dict[str, torch.Tensor]:
    """The processor outputs for prompt tokens start..end: the first pass gets every input (the
    images' too); a later one only the per-token rows (the cache holds what came before)."""
    if start == 0:
        return {name: value[:, :end] if name in PER_TOKEN_INPUTS + ("attention_mask",) else value
                for name, value in inputs.items()}
    return {name: inputs[name][:, start:end] for name in PER_TOKEN_INPUTS if name in inputs}


def path_rows(rows: torch.Tensor, path: list[int], num_tree: int) -> torch.Tensor:
    """(len(path), H) the rows of tree entries `path`, from a pass's rows (num_tree, H) of the whole tree."""
    if len(rows) != num_tree:
        raise ValueError(f"the last pass kept {len(rows)} hidden rows, the tree has {num_tree} entries")
    return rows[torch.tensor(path, device=rows.device)]


class Runner:
    """Prefill, extend and roll back one model's cache. `vocab_size` columns of logits are kept."""

    state_type = CacheState  # what `prefill` returns

    def __init__(self, model, family: Family, vocab_size: int | None = None, fast: bool = True):
        self.model = model
        self.family = family
        self.vocab_size = vocab_size
        self.device = model.device
        self.fast_fallback = fast_decode.unsupported(model) if fast else "turned off"  # None: fast path
        self.fast = fast_decode.FastDecoder(model) if self.fast_fallback is None else None

    @torch.inference_mode()
    def prefill(self, inputs: dict[str, torch.Tensor], reads: TargetReads = NO_READS,
                stop: threading.Event | None = None) -> tuple[torch.Tensor | None, CacheState]:
        """Run the prompt. inputs: processor outputs (input_ids (1, S), pixel_values, ...).

        Returns the float32 logits of the last prompt position, (V,), and the new cache state
        (with `hidden` / `shared_kv` of all S prompt positions when `reads` asks for them).
        A long prompt is read in passes (`prefill_bounds`), and `stop` is looked at between them:
        once it is set the read ends there, and the logits are None (the cache holds a part).
        """
        inputs = {name: value.to(self.device) for name, value in inputs.items()}
        position_ids, rope_delta = self.family.prefill_positions(self.model, inputs)
        cache = DynamicCache(config=self.model.config)
        cache.activate_past_recording()  # sliding-window layers keep what a rollback may need
        seq_len = inputs["input_ids"].shape[1]
        state = self.state_type(cache=cache, cache_len=seq_len, rope_pos=seq_len + rope_delta,
                                prompt_positions=position_ids, rope_delta=rope_delta, reads=reads)
        hidden = []
        for start, end in prefill_bounds(inputs, self._image_token_ids(), reads):
            if start and stop is not None and stop.is_set():
                return None, state
            out = self.model(**_prompt_part(inputs, start, end), position_ids=position_ids[..., start:end],
                             cache=cache, use_cache=True, logits_to_keep=1, **self._hidden_request(state))
            self._keep_hidden(state, out, end - start)
            hidden.append(state.hidden)
        if state.hidden:  # every pass's rows, in order
            state.hidden = {layer: torch.cat([rows[layer] for rows in hidden]) for layer in state.hidden}
        if self.fast is not None:
            state.cache = StaticKVCache.from_dynamic(cache, self.fast.stack.cache_dtype)
        self.rollback(state, 0)  # trims sliding-window layers back to their window
        return self._vocab(out.logits[0, -1]), state

    def extend(self, state: CacheState, token_ids: list[int]) -> torch.Tensor:
        """Append `token_ids` (n,) to the cache; returns float32 logits for each of them, (n, V)."""
        return self.run([Pass(state, token_ids)])[0]

    def extend_tree(self, state: CacheState, token_ids: list[int], parents: list[int]) -> torch.Tensor:
        """Append n draft-tree entries after the committed ones; returns their float32 logits, (n, V).

        parents (n,): each entry's parent, an index into the tree held so far (state.tree_parents,
        then these entries: parents[i] < len(state.tree_parents) + i), -1 for a child of the
        committed sequence. An entry sees the committed cache, its ancestors and itself (a 4-D
        attention mask), at rotary position rope_pos + depth (depth 0 for parent -1): on every
        M-RoPE row the position plain decoding would give it. cache_len and rope_pos stay those of
        the committed sequence until `keep_path` settles the tree. With hidden layers to read
        (state.reads), `hidden` holds the pass's rows of every entry; `keep_path` keeps the path's.
        """
        return self.run([Pass(state, token_ids, list(parents))])[0]

    @torch.inference_mode()
    def run(self, passes: list[Pass]) -> list[torch.Tensor]:
        """Each pass's float32 logits, (n, V), as `extend` / `extend_tree` give them, and its state moved
        on as they move it. Several requests' passes share one target pass where the fast forward can
        hold them (`FastDecoder.shares_passes`: the products over all their rows, each row summed alone,
        the attention per request over its own cache; at most MAX_VERIFY_ROWS rows a pass), so each
        request's logits are bitwise those of its own pass; elsewhere each runs its own pass."""
        for one in passes:
            if one.parents is not None and one.state.reads.shared_kv:
                raise ValueError("a tree pass computes no shared K/V for a drafter that attends to them")
        logits = [logit for group in self._shared_groups(passes) for logit in self._run_group(group)]
        for one in passes:
            if one.parents is None:
                one.state.cache_len += len(one.token_ids)
                one.state.rope_pos += len(one.token_ids)
            else:
                one.state.tree_parents = one.state.tree_parents + one.parents
        return logits

    def _shared_groups(self, passes: list[Pass]) -> list[list[Pass]]:
        """The passes in order, in groups that each run as one target pass."""
        if self.fast is None:
            return [[one] for one in passes]
        groups: list[list[Pass]] = []
        rows = 0
        for one in passes:
            rows += len(one.token_ids)
            if groups and rows <= MAX_VERIFY_ROWS and self.fast.shares_passes(rows, self.fast.stack.dtype):
                groups[-1].append(one)
            else:
                groups.append([one])
                rows = len(one.token_ids)
        return groups

    def _run_group(self, group: list[Pass]) -> list[torch.Tensor]:
        """Float32 logits (n, V) of each pass of the group, run as one pass."""
        if self.fast is None:
            (one,) = group
            return [self._forward(one.state, one.token_ids, *self._pass_inputs(one))]
        parts = [self._fast_part(one) for one in group]
        out = self.fast.forward(parts)
        for one, (_, hidden) in zip(group, out):
            if one.state.reads.hidden_layers:
                one.state.hidden = hidden
        return [self._vocab(logits) for logits, _ in out]

    def _pass_inputs(self, one: Pass) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pass's position ids as the model takes them, (1, n) or M-RoPE (3, 1, n), and its attention
        mask: None (causal) for a chain, an additive (1, 1, n, cache_len + tree) one for tree entries."""
        state, num_tokens = one.state, len(one.token_ids)
        if one.parents is None:
            return self.family.positions(state.rope_pos, num_tokens, self.device), None
        parents = state.tree_parents + one.parents
        depths = tree_depths(parents)
        position_ids = self.family.positions(state.rope_pos, max(depths) + 1, self.device)[..., depths[-num_tokens:]]
        seen = ancestor_mask(parents)[-num_tokens:].to(self.device)  # (n, tree) ancestors and self
        seen = torch.cat([seen.new_ones(num_tokens, state.cache_len), seen], dim=1)
        mask = torch.zeros(seen.shape, dtype=self.model.dtype, device=self.device)
        mask.masked_fill_(~seen, torch.finfo(self.model.dtype).min)  # additive: eager and SDPA alike
        return position_ids, mask[None, None]

    def _fast_part(self, one: Pass) -> PassPart:
        """The pass as engine/fast_decode.py takes it: text tokens move every M-RoPE row together, so
        the first row of positions is enough (a chain's: consecutive, a range)."""
        state, num_tokens = one.state, len(one.token_ids)
        if state.reads.shared_kv:
            raise ValueError("the fast forward computes no shared K/V; build the Runner with fast=False")
        if one.parents is None:
            positions, mask = range(state.rope_pos, state.rope_pos + num_tokens), None
        else:
            position_ids, mask = self._pass_inputs(one)
            positions, mask = position_ids.reshape(-1, num_tokens)[0], mask[0, 0]
        return PassPart(state.cache, one.token_ids, positions, mask, state.reads.hidden_layers)

    @torch.inference_mode()
    def keep_path(self, state: CacheState, path: list[int]) -> None:
        """Settle the draft tree: its entries `path` (a chain from a depth-0 entry, in order) become
        committed, right after the cache's committed entries; every other tree entry is dropped
        (the K/V of the path are moved into place: a compaction, not a re-run). The hidden rows a
        drafter reads become the path's, in order: what a chain pass over it would have kept."""
        start, num_tree = state.cache_len, len(state.tree_parents)
        if state.hidden:
            state.hidden = {layer: path_rows(rows, path, num_tree) for layer, rows in state.hidden.items()}
        if path != list(range(len(path))):  # else the path's entries are already in place
            source = torch.tensor(path, device=self.device) + start
            if isinstance(state.cache, StaticKVCache):
                state.cache.move(start, source)
            for layer in (layer for layer in getattr(state.cache, "layers", ()) if layer.is_initialized):
                layer.keys[..., start:start + len(path), :] = layer.keys[..., source, :]
                layer.values[..., start:start + len(path), :] = layer.values[..., source, :]
        state.cache.crop(-(num_tree - len(path)))
        state.cache_len += len(path)
        state.rope_pos += len(path)
        state.tree_parents = []

    def _image_token_ids(self) -> set[int]:
        """The ids that stand for image (or video) features in a prompt, as the model's config names them."""
        config = self.model.config
        return {value for name in IMAGE_TOKEN_FIELDS if isinstance(value := getattr(config, name, None), int)}

    @staticmethod
    def tree_unsupported(state: CacheState) -> str | None:
        """Why this cache cannot take a draft tree (None when it can): only plain full-attention
        layers keep one branch of a pass and drop the others by compaction."""
        kinds = sorted({"sliding-window" if getattr(layer, "is_sliding", False) else "linear-attention"
                        if isinstance(layer, LinearAttentionCacheLayerMixin) else type(layer).__name__
                        for layer in getattr(state.cache, "layers", ()) if type(layer) is not DynamicLayer})
        if kinds:
            return (f"the cache has {' and '.join(kinds)} layers, whose state a tree pass would mix across "
                    "branches; chains are drafted")
        return None

    def _forward(self, state: CacheState, token_ids: list[int], position_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run token_ids (n,) at position_ids over the cache with transformers' forward; float32 logits (n, V)."""
        num_tokens = len(token_ids)
        input_ids = torch.tensor([token_ids], device=self.device)
        if self.family.direct_text_steps and not state.reads:
            logits = self.family.text_step(self.model, input_ids, position_ids, state.cache, num_tokens,
                                           attention_mask)
        else:  # the full forward, which also returns what a drafter reading the target needs
            out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                             cache=state.cache, use_cache=True, logits_to_keep=num_tokens,
                             **self._hidden_request(state))
            self._keep_hidden(state, out, num_tokens)
            logits = out.logits
        return self._vocab(logits[0, -num_tokens:])

    def checkpoint(self, state: CacheState) -> None:
        """The cache holds committed tokens only, and a rollback to here may follow. Nothing to
        do where a crop reaches any entry (engine/linear_attention_rollback.py copies recurrent states here)."""

    def rollback(self, state: CacheState, num_tokens: int) -> None:
        """Drop the last `num_tokens` entries (0 is valid: it trims sliding-window layers)."""
        state.cache.crop(-num_tokens)
        state.cache_len -= num_tokens
        state.rope_pos -= num_tokens

    @staticmethod
    def _hidden_request(state: CacheState) -> dict:
        request = {"output_hidden_states": list(state.reads.hidden_layers)} if state.reads.hidden_layers else {}
        return {**request, "return_shared_kv_states": True} if state.reads.shared_kv else request

    @staticmethod
    def _keep_hidden(state: CacheState, out, num_tokens: int) -> None:
        """state.hidden = {layer: (num_tokens, H)} of the pass `out`, when the state reads any
        (and state.shared_kv, when it reads those)."""
        if state.reads.hidden_layers:
            states = out.hidden_states
            state.hidden = {layer: states[layer][0, -num_tokens:] for layer in state.reads.hidden_layers}
        if state.reads.shared_kv:
            state.shared_kv = dict(out.shared_kv_states)

    def _vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Float32 logits over exactly `vocab_size` ids (the target's): extra rows of a drafter's
        padded vocabulary are cut, missing ones are -inf so they are never drawn."""
        logits = logits.float()
        if not self.vocab_size or logits.shape[-1] == self.vocab_size:
            return logits
        if logits.shape[-1] > self.vocab_size:
            return logits[..., : self.vocab_size]
        missing = self.vocab_size - logits.shape[-1]
        return torch.nn.functional.pad(logits, (0, missing), value=float("-inf"))
