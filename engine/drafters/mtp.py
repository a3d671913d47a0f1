"""MTP drafter: the multi-token-prediction layers a checkpoint carries (Step-3.7, DeepSeek-V3 style).

Serves: `--drafter mtp`, for a target whose config declares MTP layers (`num_mtp_layers` /
`num_nextn_predict_layers`); the layers are read again from the target's own checkpoint.
Qwen3.5 / 3.6 checkpoints (`mtp_num_hidden_layers`), for which transformers builds no MTP
module, get the project's MTP head built from their `mtp.*` weights (engine/drafters/mtp_head.py).
Reads from the target: hidden state 0 (the merged input embeddings) and -1 (the last).

MTP layer k (0-based) at entry j reads two things and predicts token j + k + 2:
    the embedding of token j + k + 1   and   the hidden state of entry j one level down
(level -1 is the target's last hidden state h_j; level k-1 the output of MTP layer k-1).
With the committed sequence x_0 .. x_T (x_T is the newest token, which the target has not
run yet), the target's hidden states h_0 .. h_{T-1} are known, and each round drafts
    layer 0 at entry T-1  ->  d_1 = x_{T+1}
    layer 1 at entry T-1  ->  d_2 (it embeds d_1), ...
one token per layer: a draft is at most `num_mtp_layers` long.

What differs from transformers' `generate(use_mtp=True)`:
- embeddings: at prompt positions the MTP layers embed the target's *merged* input embeddings
  (image features at image positions, read from the target's prefill as hidden state 0), not
  the embedding of the image placeholder id;
- positions: entry j of layer k sits at the target's rotary position of token j + k + 1, sliced
  on the sequence axis (all M-RoPE rows), so they follow the target after an image;
- the cache covers the whole prompt from the first round.

Bookkeeping. Each layer has its own KV cache over entries 0 .. n_k - 1 and remembers which
token ids it embedded. Layer 0 only ever embeds committed tokens (x_{j+1} with j <= T-1), so
it never rolls back. Layer k's last k entries embed draft tokens; before drafting, each layer
keeps the longest prefix of entries whose embedded tokens are the committed ones (and whose
input from the layer below was kept), crops the rest and recomputes from there.
"""

from __future__ import annotations

import torch

from engine.drafters import mtp_head
from engine.drafters.base import Draft, DraftBuilder
from engine.drafters.target_session import TargetReadingSession, tokens_from
from engine.prompt import Prompt
from engine.runner import CacheState, TargetReads
from engine.sampling import Sampler
from models.loading import LoadError


KEYWORD = "mtp"


def serves(name: str, config) -> bool:
    return name == KEYWORD


def load(name: str, config, target, options) -> MtpDrafter:
    from transformers.modeling_layers import MtpModel

    text_config = target.model.config.get_text_config()
    if getattr(text_config, "mtp_num_hidden_layers", None):  # Qwen3.5 / 3.6
        return mtp_head.load_qwen3_5(name, target, options)
    if not getattr(text_config, "num_mtp_layers", None):
        raise LoadError(f"--drafter mtp: {target.name!r} ({text_config.model_type}) declares no MTP layers "
                        "(num_mtp_layers / num_nextn_predict_layers); pick another drafter")
    try:
        mtp = MtpModel.from_pretrained(target.model, device_map={"": target.model.device}).eval()
    except (OSError, RuntimeError, ValueError) as error:
        raise LoadError(f"--drafter mtp: cannot read the MTP layers of {target.name!r}: {error}") from error
    return MtpDrafter(KEYWORD, mtp, target.model, target.family)


class MtpDrafter:
    kind = "mtp"
    reads = TargetReads(hidden_layers=(0, -1))  # merged input embeddings, last hidden state
    fast_fallback = "transformers' MtpModel: its layers' own forward and MtpCache (no fast path written)"

    def __init__(self, name: str, mtp_model, target_model, family):
        """mtp_model: transformers' MtpModel (weights read from the target's checkpoint)."""
        self.name = name
        self.mtp = mtp_model
        self.target_model = target_model
        self.family = family
        self.num_layers = len(mtp_model.layers)

    @torch.inference_mode()
    def begin(self, prompt: Prompt, target: CacheState) -> MtpSession:
        return MtpSession(self, prompt, target)


class MtpSession(TargetReadingSession):
    @torch.inference_mode()
    def __init__(self, drafter: MtpDrafter, prompt: Prompt, target: CacheState):
        from transformers.cache_utils import MtpCache

        super().__init__(drafter.family, target, (-1,))  # pending: (m, H) target h_j layer 0 has not read yet
        self.mtp, self.target_model, self.num_layers = drafter.mtp, drafter.target_model, drafter.num_layers
        self.prompt_ids = prompt.input_ids
        self.prompt_embeds = target.hidden[0]  # (S, H) the target's merged input embeddings
        self.cache = MtpCache(config=self.target_model.config.get_mtp_config())
        self.cache.activate_past_recording()
        self.fed: list[list[int]] = [[] for _ in range(self.num_layers)]  # per layer: token embedded at each entry
        hidden = self.prompt_embeds.shape[-1]
        # per layer: output rows of the last entries (a tail), and the entry index of outs[k][0]
        self.outs = [self.prompt_embeds.new_zeros(0, hidden) for _ in range(self.num_layers)]
        self.outs_start = [0] * self.num_layers

    @torch.inference_mode()
    def propose(self, generated: list[int], k: int, sampler: Sampler) -> Draft:
        last_entry = len(self.prompt_ids) + len(generated) - 2  # T - 1: the newest entry every layer drafts from
        # Only a layer's last num_layers entries can have embedded a draft token; the tokens
        # before them are compared and read no more: a round costs O(new tokens).
        base = max(0, min(len(fed) for fed in self.fed) - self.num_layers)
        known = tokens_from(self.prompt_ids, generated, base)  # x_base .. x_T
        builder = DraftBuilder(sampler)
        kept = None  # entries the layer below kept (its later entries were recomputed)
        for level in range(min(k, self.num_layers)):
            kept = self._keep_valid(level, base, known + builder.token_ids, limit=kept)
            rows = self._run(level, kept, last_entry, base, known + builder.token_ids)  # (n, H)
            builder.sample(self._logits(rows[-1]))
        for level in range(self.num_layers - 1):  # keep the rows the layer above may read again
            self._trim_outs(level, keep_from=len(self.fed[level + 1]) - self.num_layers)
        return builder.draft()

    # Steps of one layer

    def _keep_valid(self, level: int, base: int, tokens: list[int], limit: int | None) -> int:
        """Crop the layer to its leading entries that embedded the tokens now known (committed
        ones, or this round's draft below this level; tokens[i - base] is x_i) and read rows the
        layer below kept; returns how many it kept."""
        fed = self.fed[level]
        limit = len(fed) if limit is None else min(len(fed), limit)
        valid = min(limit, max(0, len(fed) - self.num_layers))  # earlier entries embedded committed tokens
        while (valid < limit and valid + level + 1 - base < len(tokens)
               and fed[valid] == tokens[valid + level + 1 - base]):
            valid += 1
        self.cache.layers[level].crop(valid - len(fed))
        del fed[valid:]
        return valid

    def _run(self, level: int, start: int, last_entry: int, base: int, tokens: list[int]) -> torch.Tensor:
        """Run entries start .. last_entry of layer `level` (tokens[i - base] is x_i); returns
        their output rows (n, H)."""
        if level == 0:
            below = self.take_pending()  # h_start .. h_last_entry
        else:
            below = self._rows(level - 1, start, last_entry + 1)
        token_ids = tokens[start + level + 1 - base: last_entry + level + 2 - base]
        embeds = self.embeds(start + level + 1, token_ids)
        positions = self.positions(start + level + 1, last_entry + level + 2)
        out = self.mtp.forward_layer(level, below[None].to(embeds.dtype), positions, self.cache,
                                     inputs_embeds=embeds[None])[0]
        self.fed[level] += token_ids
        self._append_outs(level, start, out)
        return out

    def embed_tokens(self, token_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(token_ids, device=self.prompt_embeds.device)
        return self.mtp.embed_tokens(ids).to(self.prompt_embeds.dtype)

    def _logits(self, row: torch.Tensor) -> torch.Tensor:
        """Float32 logits (V,) of one MTP output row, through the target's head."""
        vocab_size = self.target_model.get_output_embeddings().weight.shape[0]
        return self.mtp._project_to_logits(row[None, None])[0, 0, :vocab_size].float()

    # Output rows of each layer: the input of the layer above

    def _append_outs(self, level: int, start: int, rows: torch.Tensor) -> None:
        if level == self.num_layers - 1:
            return  # no layer above reads the top layer's rows
        keep = start - self.outs_start[level]
        self.outs[level] = torch.cat([self.outs[level][:keep], rows])

    def _rows(self, level: int, start: int, stop: int) -> torch.Tensor:
        offset = self.outs_start[level]
        if start < offset or stop - offset > len(self.outs[level]):
            raise RuntimeError(f"MTP layer {level} rows {start}..{stop} are not kept (kept from {offset})")
        return self.outs[level][start - offset: stop - offset]

    def _trim_outs(self, level: int, keep_from: int) -> None:
        drop = max(0, min(keep_from - self.outs_start[level], len(self.outs[level])))
        self.outs[level] = self.outs[level][drop:]
        self.outs_start[level] += drop
