"""EAGLE-3 drafter: a SpecForge or vLLM `speculators` checkpoint (models/eagle3.py: the formats
and the layer's arithmetic), at the target's own positions, M-RoPE included.

Serves: a `--drafter` folder or hub id whose config.json is an EAGLE-3 config (SpecForge's
`architectures: ["LlamaForCausalLMEagle3"]`, or `speculators_model_type: "eagle3"`). It must fit
the target: its `target_hidden_size` and vocabulary are the target's, the three layers it reads
exist (hidden_states indices below the target's depth), its draft ids map into the target's
vocabulary, and an M-RoPE target gets an M-RoPE layer.
Reads from the target: its three layers (default 2, N/2, N - 3) and hidden state 0, the merged
input embeddings, which give the embedding at image positions.

Entry j embeds token j + 1 and reads g_j = fc(the target's three rows of token j), at the
target's rotary position of token j (three M-RoPE rows in the prompt, i + rope_delta after it);
it predicts token j + 2. With committed tokens x_0 .. x_T (the target has run x_0 .. x_{T-1}),
a round of k drafts:

    entries context_len .. T-1   embed x_{j+1}, read g_j                 -> d_1 from entry T-1
    entry T                      embeds d_1, reads entry T-1's h         -> d_2 (position of T)
    entry T + i - 2              embeds d_{i-1}, reads the entry before  -> d_i

Embeddings: the checkpoint's own `embed_tokens` (the target's table where it has none), except
at prompt positions where the target merged image features, which get the target's merged
embedding (what SpecForge trains on; vLLM gives the placeholder's embedding there). Logits are
over the draft vocabulary, placed at target ids d + d2t[d]; every other id is -inf.

The layer runs in one compiled call (engine/fast_heads.py FastEagle3) where it is covered, else
in the module's forward; its products, and fc's and the output head's, in the rows kernel.
One KV cache. Entries 0 .. T-1 read the target's rows and are never undone; draft entries are
cropped at the next round, whatever was accepted, and the accepted tokens' entries are
recomputed from the target's rows of the verify pass (`pending`, engine/drafters/target_session.py).
Worked example: prompt of 10 tokens, x_10 from prefill. Round 1 runs entries 0 .. 9 and drafts
d_1 .. d_4 from entries 9, 10, 11, 12. The target accepts 2 (rows for x_10, d_1, d_2; bonus
x_13); round 2 crops the cache to 10 entries, runs entries 10 .. 12, and drafts from entry 12.

Trees (`propose_tree`, engine/drafters/target_session.py's ChainedHeadSession): depth by
depth, EAGLE-2's beam; a node at depth d embeds its token and reads its parent's h at the
target's position of T + d - 1, seeing the context, its ancestors' entries and itself. The
target's tree pass hands back its rows of the accepted path, so the next round is as after a chain.
"""

from __future__ import annotations

import torch

from engine import fast_heads
from engine.drafters.base import Draft, DraftBuilder
from engine.drafters.target_head import full_vocabulary, module_dtype, require_hidden
from engine.drafters.target_session import ChainedHeadSession, tokens_from
from engine.rows_kernel import RowsKernelLinear
from engine.prompt import Prompt
from engine.runner import CacheState, TargetReads
from engine.sampling import Sampler
from models import eagle3 as checkpoint
from models.drafter_heads import causal_mask
from models.loading import LoadError


def serves(name: str, config) -> bool:
    return isinstance(config, checkpoint.Eagle3Config)


def read_config(name: str) -> checkpoint.Eagle3Config | None:
    """The EAGLE-3 config of `name`, None if it is none; LoadError for one that cannot run here."""
    try:
        return checkpoint.read_config(name)
    except (checkpoint.FormatError, KeyError) as error:
        raise LoadError(f"EAGLE-3 drafter {name!r} cannot run here: {error}") from error


def fit_problems(config: checkpoint.Eagle3Config, target) -> list[str]:
    """Why the checkpoint does not fit the target (empty when it does)."""
    text = target.model.config.get_text_config()
    problems = []
    if config.target_hidden_size != text.hidden_size:
        problems.append(f"it reads target hidden states of size {config.target_hidden_size}, the target's are "
                        f"{text.hidden_size}")
    if config.vocab_size != text.vocab_size:
        problems.append(f"it was made for a vocabulary of {config.vocab_size}, the target's is {text.vocab_size}")
    layers = config.target_layers(text.num_hidden_layers)
    if len(layers) != 3 or not all(0 <= layer < text.num_hidden_layers for layer in layers):
        problems.append(f"it reads target layers {list(layers)}, the target has {text.num_hidden_layers} "
                        f"(hidden_states 0 .. {text.num_hidden_layers - 1})")
    if target.family.positions(0, 1, "cpu").dim() == 3 and config.mrope_section is None:
        problems.append(f"its rotary embedding is 1-axis, the target ({target.family.name}) numbers positions on "
                        "three M-RoPE rows")
    if config.mrope_section is not None and sum(config.mrope_section) != config.head_dim // 2:
        problems.append(f"its mrope_section {config.mrope_section} does not cover head_dim {config.head_dim}")
    return problems


def load(name: str, config: checkpoint.Eagle3Config, target, options) -> Eagle3Drafter:
    problems = fit_problems(config, target)
    if problems:
        raise LoadError(f"EAGLE-3 drafter {name!r} ({config.format}) does not fit the target {target.name!r}: "
                        + "; ".join(problems) + ". Use the EAGLE-3 checkpoint trained for this target.")
    try:
        # its products in the rows kernel where it builds (fc, the output head, the layer where it runs as a module)
        module = checkpoint.load(name, config, torch.float32, target.model.device, linear=RowsKernelLinear)
    except (checkpoint.FormatError, OSError) as error:
        raise LoadError(f"cannot load EAGLE-3 drafter {name!r}: {' '.join(str(error).split())}") from error
    module = module.to(module_dtype(target, options, sum(p.numel() for p in module.parameters())))
    target_ids = module.target_ids()
    if int(target_ids.max()) >= target.vocab_size or int(target_ids.min()) < 0:
        raise LoadError(f"EAGLE-3 drafter {name!r} maps draft ids to target ids {int(target_ids.min())} .. "
                        f"{int(target_ids.max())} (d2t), outside the target's vocabulary of {target.vocab_size}")
    layers = config.target_layers(target.model.config.get_text_config().num_hidden_layers)
    return Eagle3Drafter(name, module, target, layers)


class Eagle3Drafter:
    kind = "eagle3"

    def __init__(self, name: str, module: checkpoint.Eagle3, target, layers: tuple[int, ...]):
        self.name, self.module, self.family, self.layers = name, module, target.family, layers
        self.fast_fallback = fast_heads.eagle3_unsupported(module)  # None: the layer runs compiled
        # the layer: compiled (fast_heads.FastEagle3), or the module's forward, its products in the rows kernel
        self.layer = fast_heads.FastEagle3(module) if self.fast_fallback is None else module
        self.draft_logits = module.draft_logits if self.fast_fallback else self.layer.draft_logits  # (n, draft V)
        self.reads = TargetReads(hidden_layers=tuple(dict.fromkeys((0, *layers))))
        self.target_embedding = target.model.get_input_embeddings()
        self.dtype = next(module.parameters()).dtype
        self.target_ids = module.target_ids()  # (draft vocab,)
        self.vocab_size = target.vocab_size

    def new_cache(self, num_tokens: int):
        """An empty cache of the layer's kind for a context of about num_tokens entries."""
        return self.layer.new_cache(num_tokens) if self.fast_fallback is None else checkpoint.KVCache()

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(n, H) the checkpoint's embeddings of token ids (the target's table where it has none)."""
        table = getattr(self.module, "embed_tokens", None)
        table = self.target_embedding if table is None else table
        return table(token_ids.to(self.target_ids.device)).to(self.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(n, V) float32 target-vocabulary logits of pre-norm rows h (n, H)."""
        return full_vocabulary(self.draft_logits(h).float(), self.target_ids, self.vocab_size)

    @torch.inference_mode()
    def begin(self, prompt: Prompt, target: CacheState) -> Eagle3Session:
        require_hidden(self.name, target, self.reads.hidden_layers)
        return Eagle3Session(self, prompt, target)


class Eagle3Session(ChainedHeadSession):
    def __init__(self, drafter: Eagle3Drafter, prompt: Prompt, target: CacheState):
        super().__init__(drafter.family, target, drafter.layers)  # pending: (m, 3H) rows of tokens context_len ..
        self.drafter, self.module = drafter, drafter.module
        self.prompt_ids = prompt.input_ids
        self.prompt_embeds = self._prompt_embeds(target.hidden[0])  # (S, H)
        self.cache = drafter.new_cache(len(self.prompt_ids))
        self.context_len = 0  # entries that read the target's rows (0 .. context_len - 1)

    def _prompt_embeds(self, merged: torch.Tensor) -> torch.Tensor:
        """The drafter's embeddings of the prompt, with the target's merged ones where those are not
        the target's table rows (image features)."""
        ids = torch.tensor(self.prompt_ids, device=merged.device)
        table = self.drafter.target_embedding(ids).to(merged.dtype)
        image = (table != merged).any(-1)  # (S,) positions the target filled with image features
        own = self.drafter.embed(ids)
        return torch.where(image[:, None], merged.to(own.dtype), own)

    def embed_tokens(self, token_ids: list[int]) -> torch.Tensor:
        return self.drafter.embed(torch.tensor(token_ids))

    @torch.inference_mode()
    def propose(self, generated: list[int], k: int, sampler: Sampler) -> Draft:
        if k <= 0:
            return Draft([])
        h = self._context(generated)  # (1, H) the newest context entry's
        builder = DraftBuilder(sampler)
        token = builder.sample(self.drafter.logits(h)[0])
        for entry in range(self.context_len, self.context_len + k - 1):
            h = self._run(self.embed_tokens([token]), self.module.feedback(h), entry)
            token = builder.sample(self.drafter.logits(h)[0])
        return builder.draft()

    def _context(self, generated: list[int]) -> torch.Tensor:
        """Drop last round's draft entries, run the entries of the committed tokens not yet run
        (the target's rows in `pending`); (1, H) the newest one's pre-norm h, which drafts d_1."""
        newest = len(self.prompt_ids) + len(generated) - 1  # T: x_0 .. x_T are committed
        self.cache.crop(self.context_len)
        first = self.context_len
        token_ids = tokens_from(self.prompt_ids, generated, first + 1)  # x_{first+1} .. x_T
        g = self.module.project(self.take_pending().to(self.drafter.dtype))  # (T - first, H)
        h = self._run(self.embeds(first + 1, token_ids), g, first)  # entries first .. T-1
        self.context_len = newest
        return h[-1:]

    def _run(self, embeds: torch.Tensor, hidden: torch.Tensor, first: int) -> torch.Tensor:
        """Entries first .. first + n - 1 (embeds, hidden (n, H)), at the target's positions of
        tokens first ..; appended to the cache. Returns the pre-norm h (n, H)."""
        n = len(embeds)
        mask = causal_mask(n, len(self.cache), embeds.device) if len(self.cache) and n > 1 else None
        positions = self.positions(first, first + n)
        return self.drafter.layer(embeds[None], hidden[None], positions, self.cache, mask)[0]

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.drafter.logits(out)

    def _tree_entries(self, token_ids: list[int], parent_out: torch.Tensor, level: int, seen: torch.Tensor) -> torch.Tensor:
        """Nodes at depth level + 1: their tokens' embeddings and their parents' h, at the target's
        position of token T + level, each seeing `seen` (n, cached + n)."""
        positions = self.positions(self.context_len + level, self.context_len + level + 1)
        positions = positions.expand(*positions.shape[:-1], len(token_ids))
        return self.drafter.layer(self.embed_tokens(token_ids)[None], self.module.feedback(parent_out)[None],
                                  positions, self.cache, seen.to(parent_out.device)[None, None])[0]
