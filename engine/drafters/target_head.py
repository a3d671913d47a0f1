"""What the project's own drafter modules (models/drafter_heads.py) share with the target: its
embedding table and output head, and the fit checks and loading both of them need.

The modules hold neither table: a draft token is embedded by the target's own input embedding
and a module's output row becomes logits through the target's own output head (weights cast
once to the module's dtype when they differ: on a CPU the module runs in float32 by default,
whatever the target's dtype, as small language-model drafters do). A module with a reduced
output vocabulary (`draft_ids`) uses only those rows of the head; its logits are -inf at every
other id.
"""

from __future__ import annotations

import torch
from transformers.utils import cached_file

from engine.drafters.base import DrafterUnavailable
from engine.rows_kernel import rows_product
from engine.runner import CacheState
from models import drafter_heads
from models.loading import SMALL_DRAFTER_PARAMETERS, LoadError, LoadOptions

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TargetHead:
    """The target's embedding and output head (its rows of `draft_ids` only, when given), in the
    drafter module's dtype."""

    def __init__(self, target, dtype: torch.dtype, draft_ids: torch.Tensor | None = None):
        self.embedding = target.model.get_input_embeddings()
        weight = target.model.get_output_embeddings().weight.detach()  # (V, H)
        self.head_weight = (weight if draft_ids is None else weight[draft_ids]).to(dtype)  # (V or D, H)
        self.draft_ids, self.vocab_size = draft_ids, target.vocab_size
        self.dtype = dtype

    @classmethod
    def of(cls, target, module) -> TargetHead:
        """The head a drafter module reads: in its dtype, over its `draft_ids` if it has them."""
        return cls(target, next(module.parameters()).dtype, getattr(module, "draft_ids", None))

    def embed(self, token_ids: list[int]) -> torch.Tensor:
        """(n, H) the target's input embeddings of text tokens (its own scaling included)."""
        ids = torch.tensor(token_ids, device=self.head_weight.device)
        return self.embedding(ids).to(self.dtype)

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """(n, V) float32 logits of module output rows (n, H)."""
        logits = rows_product(rows.to(self.dtype), self.head_weight).float()
        return logits if self.draft_ids is None else full_vocabulary(logits, self.draft_ids, self.vocab_size)


def full_vocabulary(draft_logits: torch.Tensor, target_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(n, V) logits over the target's vocabulary from (n, D) logits over a draft vocabulary whose
    entry d is target id target_ids[d]; -inf at every other id (never drafted, probability 0)."""
    full = draft_logits.new_full((len(draft_logits), vocab_size), float("-inf"))
    return full.index_copy_(1, target_ids, draft_logits)  # about half index_put's time (full[:, ids] = ...)


def module_dtype(target, options: LoadOptions, parameters: int) -> torch.dtype:
    """`--drafter-dtype`, or for "auto": on a CPU float32 for a module of under
    SMALL_DRAFTER_PARAMETERS weights read a step (its parameters and the output-head rows it
    reads; a CPU's bfloat16 matmuls cost more at these sizes), bfloat16 for a larger one where
    the CPU computes in bfloat16 (AVX512-BF16 or AMX: the SmolLM2 demo's 14.5 M EAGLE-3 layer
    6.0 -> 3.1 ms a step, its bench step 6.2 -> 3.3 ms), else float32; the target's dtype elsewhere."""
    if options.drafter_dtype in DTYPES:
        return DTYPES[options.drafter_dtype]
    if target.model.device.type == "cpu":
        large = parameters >= SMALL_DRAFTER_PARAMETERS
        return torch.bfloat16 if large and cpu_computes_bfloat16() else torch.float32
    if target.model.dtype not in DTYPES.values():
        return torch.float32
    return target.model.dtype


def cpu_computes_bfloat16() -> bool:
    """Whether this CPU has bfloat16 arithmetic (AVX512-BF16 or AMX tiles), where torch's bfloat16
    products read half the bytes at no extra cost."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, check, lambda: False)() for check in checks)


def load_module(name: str, config, target, options: LoadOptions, layers: tuple[int, ...] = ()):
    """The module in folder (or hub id) `name`, after checking it fits the target; LoadError if not."""
    text = target.model.config.get_text_config()
    problems = []
    if config.hidden_size != text.hidden_size:
        problems.append(f"its hidden size is {config.hidden_size}, the target's {text.hidden_size}")
    if config.vocab_size != target.vocab_size:
        problems.append(f"it was made for a vocabulary of {config.vocab_size} rows, the target has {target.vocab_size}")
    outside = [layer for layer in layers if not -text.num_hidden_layers - 1 <= layer <= text.num_hidden_layers]
    if outside:
        problems.append(f"it reads target hidden states {list(layers)}, the target has {text.num_hidden_layers} layers")
    if problems:
        raise LoadError(f"drafter {name!r} ({config.model_type}, made for {config.target_model_type}) does not fit the "
                        f"target {target.name!r}: " + "; ".join(problems) + ". Use one trained for this target "
                        "(python -m models.demo.train_drafters trains them for the bundled model).")
    try:
        weights = cached_file(name, "model.safetensors")
    except OSError as error:
        raise LoadError(f"drafter {name!r} has no model.safetensors: {str(error).splitlines()[0]}") from error
    try:
        module = drafter_heads.load_weights(config, weights, dtype=torch.float32, device=target.model.device)
    except RuntimeError as error:  # missing, unexpected or mis-shaped weights
        raise LoadError(f"cannot load drafter {name!r}: {' '.join(str(error).split())}") from error
    draft_ids = getattr(module, "draft_ids", None)
    if draft_ids is not None and not (0 <= int(draft_ids.min()) and int(draft_ids.max()) < target.vocab_size):
        raise LoadError(f"drafter {name!r} drafts target ids {int(draft_ids.min())} .. {int(draft_ids.max())} "
                        f"(draft_ids), outside the target's vocabulary of {target.vocab_size}")
    return module.to(module_dtype(target, options, weights_read(module, target)))


def weights_read(module, target) -> int:
    """The weights a draft step of a module reads: its parameters and the rows of the target's
    output head it uses (its `draft_ids`, or the whole vocabulary)."""
    draft_ids = getattr(module, "draft_ids", None)
    rows = len(draft_ids) if draft_ids is not None else target.vocab_size
    return sum(p.numel() for p in module.parameters()) + rows * module.config.hidden_size


def require_hidden(name: str, target: CacheState, layers: tuple[int, ...]) -> None:
    """DrafterUnavailable unless the target's last pass kept rows of every layer this drafter reads."""
    hidden = target.hidden or {}
    missing = [layer for layer in layers if hidden.get(layer) is None or len(hidden[layer]) == 0]
    if missing:
        raise DrafterUnavailable(f"drafter {name} has no context: the target's pass kept no hidden states of "
                                 f"layers {missing} for this request; decoding plainly")
