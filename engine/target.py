"""The target: a loaded VLM and the Runner that decodes with it.

A target with linear-attention layers (Qwen3.5) gets a HybridRunner, whose rollback rewinds
the recurrent state (engine/linear_attention_rollback.py); every other target a Runner, whose rollback crops the
KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.linear_attention_rollback import runner_for
from engine.runner import Runner
from models.families import Family
from models.loading import LoadError, LoadOptions, load_config, load_vlm


@dataclass
class Target:
    name: str
    model: torch.nn.Module
    processor: object
    family: Family
    runner: Runner
    placeholder_ids: frozenset[int]  # image placeholder / marker ids: never drafted

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]


def load_target(name: str, options: LoadOptions = LoadOptions()) -> Target:
    config = load_config(name, options)
    vlm = load_vlm(name, options, config)
    runner = runner_for(vlm.model, vlm.family)
    if options.quantization == "int8":
        quantize_int8(runner, name)
    return Target(name, vlm.model, vlm.processor, vlm.family, runner, vlm.placeholder_ids)


def quantize_int8(runner: Runner, name: str) -> None:
    """`--quantization int8`: the fast path's decode and verify passes read int8 weights
    (engine/fast_decode.py, Int8Weight); prefill keeps the model's own. Refused where the fast
    path does not cover the model."""
    if runner.fast is None:
        raise LoadError(f"--quantization int8 needs the fast decode path, which does not cover {name!r} "
                        f"({runner.fast_fallback}); use --quantization 8bit (bitsandbytes) or none")
    try:
        runner.fast.quantize_int8()
    except ValueError as error:
        raise LoadError(f"--quantization int8 on {name!r}: {error}; use --dtype float32 or none") from None
