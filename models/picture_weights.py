"""Picture weights: a second set of language-model weights for conversations that hold a picture.

A model folder may carry `picture_weights.safetensors` beside its weights: low-rank updates of
its decoder layers' projections (`<weight key minus ".weight">.lora_A`, (rank, in), and
`.lora_B`, (out, rank); the update of W is lora_B @ lora_A). The engine then loads the model
twice: as it is, for conversations of text alone, and with the updates added, for
conversations that hold at least one picture (engine/target.py, `Target.runner_for`). The
SmolLM2 demo ships its picture adapters this way (models/demo/picture_adapters.py), so its text
turns are SmolLM2-135M-Instruct's by construction.

Only decoder-layer projections may change: the embeddings, the output head, the norms and the
vision tower are shared by both, so a drafter that reads the target's embedding or head
(EAGLE-3, the MTP head) is right for either. Anything else in the file is refused at load.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch

FILE = "picture_weights.safetensors"
PROJECTION = re.compile(r"(?:^|\.)layers\.\d+\.(?:self_attn|mlp)\.[a-z_]+_proj$")


class PictureWeightsError(ValueError):
    """A picture-weights file that does not fit its model (the reason names the key)."""


def load(folder: str | Path) -> dict[str, torch.Tensor] | None:
    """The folder's low-rank updates ({key.lora_A, key.lora_B}), or None when it has none (or is a hub id)."""
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    return load_file(path)


def merge(state: dict[str, torch.Tensor], deltas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (a state dict) with each update added to its weight, computed in float32 and
    stored in the weight's dtype; the update entries themselves are left out."""
    merged = dict(state)
    for base in bases(deltas):
        weight = merged[f"{base}.weight"]
        update = (deltas[f"{base}.lora_B"].float() @ deltas[f"{base}.lora_A"].float()).to(weight.device)
        merged[f"{base}.weight"] = (weight.float() + update).to(weight.dtype)
    return merged


def bases(deltas: dict[str, torch.Tensor]) -> list[str]:
    """The weights the updates change (their keys less ".weight"); PictureWeightsError when an
    entry is not a projection's lora_A / lora_B pair."""
    found = []
    for key in deltas:
        base, _, part = key.rpartition(".")
        if part not in ("lora_A", "lora_B") or not PROJECTION.search(base):
            raise PictureWeightsError(f"{key!r} is not a decoder projection's lora_A / lora_B (only those may change)")
        other = f"{base}.{'lora_B' if part == 'lora_A' else 'lora_A'}"
        if other not in deltas:
            raise PictureWeightsError(f"{key!r} has no {other!r}")
        if part == "lora_A":
            found.append(base)
    return found


def picture_model(model: torch.nn.Module, deltas: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A copy of `model` with the updates added to its projections (the model is untouched);
    PictureWeightsError naming the first update that does not fit (an unknown weight, a shape)."""
    state = model.state_dict()
    changed = bases(deltas)
    for base in changed:
        weight, down, up = state.get(f"{base}.weight"), deltas[f"{base}.lora_A"], deltas[f"{base}.lora_B"]
        if weight is None:
            raise PictureWeightsError(f"{base}.weight: no such weight in the model")
        if down.dim() != 2 or up.dim() != 2 or (up.shape[0], down.shape[1]) != tuple(weight.shape) \
                or up.shape[1] != down.shape[0]:
            raise PictureWeightsError(f"{base}: update {tuple(up.shape)} @ {tuple(down.shape)} does not fit the "
                                      f"weight {tuple(weight.shape)}")
    pictures = copy.deepcopy(model)
    merged = merge({f"{base}.weight": state[f"{base}.weight"] for base in changed}, deltas)
    with torch.no_grad():
        for key, value in merged.items():
            pictures.get_parameter(key).copy_(value)  # copy_ moves the float32 sum to the weight's device
    return pictures.eval()


def for_pictures(folder: str | Path, model: torch.nn.Module) -> torch.nn.Module:
    """The model a conversation with a picture runs: `model` (loaded from `folder`) with the
    folder's picture weights added, or `model` itself when the folder has none. For scripts that
    load a target with transformers (the demo's distillation and drafter training)."""
    deltas = load(folder)
    return model if deltas is None else picture_model(model, deltas)
