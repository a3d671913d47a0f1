"""The target: a loaded VLM and the Runner that decodes with it.

A target with linear-attention layers (Qwen3.5) gets a HybridRunner, whose rollback rewinds
the recurrent state (engine/linear_attention_rollback.py); every other target a Runner, whose rollback crops the
KV cache.

A folder with picture weights (models/picture_weights.py: low-rank updates of the decoder's
projections, the SmolLM2 demo's picture adapters) is loaded twice: as it is, for conversations
of text alone, and with the updates added, for conversations that hold a picture
(`runner_for`). Text turns are then the folder's own weights' answers by construction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine import fast_native, packed
from engine.fast_decode import FUSED
from engine.linear_attention_rollback import runner_for
from engine.runner import Runner
from models import picture_weights
from models.families import Family
from models.loading import (FAST_QUANTIZATIONS, LoadError, LoadOptions, copy_out_of_weight_files, load_config,
                            load_vlm)

log = logging.getLogger(__name__)


@dataclass
class Target:
    name: str
    model: torch.nn.Module
    processor: object
    family: Family
    runner: Runner
    placeholder_ids: frozenset[int]  # image placeholder / marker ids: never drafted
    picture_runner: Runner | None = None  # the picture weights' runner, for conversations with a picture

    def runner_for(self, num_images: int) -> Runner:
        """The runner that answers a conversation holding `num_images` images."""
        return self.picture_runner if num_images and self.picture_runner is not None else self.runner

    def model_for(self, num_images: int) -> torch.nn.Module:
        return self.runner_for(num_images).model

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]


def load_target(name: str, options: LoadOptions = LoadOptions()) -> Target:
    config = load_config(name, options)
    vlm = load_vlm(name, options, config)
    runners = [runner_for(vlm.model, vlm.family)]
    deltas = picture_weights.load(name)
    if deltas is not None:
        try:
            runners.append(runner_for(picture_weights.picture_model(vlm.model, deltas), vlm.family))
        except picture_weights.PictureWeightsError as error:
            raise LoadError(f"{name}/{picture_weights.FILE}: {error}") from None
        log.info("%s: picture weights loaded (%d updated projections): conversations with a picture use them",
                 name, len(deltas) // 2)
    if options.quantization in FAST_QUANTIZATIONS:
        for runner in runners:
            quantize_fast(runner, name, options.quantization)
    elif deltas is not None:
        adapt_packed(runners, name, deltas)
    if options.weight_arithmetic != "float":
        use_weight_arithmetic(runners, name, options)
    copied = copy_out_of_weight_files([runner.model for runner in runners])  # the file's pages can go now
    if copied:
        log.info("%s: %.1f MB of weights copied out of the weights file, so that its mapping goes", name, copied / 1e6)
    return Target(name, vlm.model, vlm.processor, vlm.family, runners[0], vlm.placeholder_ids,
                  runners[1] if len(runners) > 1 else None)


def adapt_packed(runners: list[Runner], name: str, deltas: dict) -> None:
    """Where the text runner reads its weights from GGUF blocks (engine/packed.py), the picture
    runner reads the same blocks and adds the picture weights' low-rank updates on their own
    (packed.Adapted), instead of streaming merged float32 weights: the same sums, reordered."""
    text, pictures = (runner.fast for runner in runners)
    adapted = packed.adapt(text.stack.layers, deltas, FUSED) if text is not None and pictures is not None else None
    if adapted is not None:
        pictures.stack.layers = adapted
        if isinstance(text.head_weight, packed.PackedWeight):  # the same output layer (picture weights never change it)
            pictures.head_weight = text.head_weight
        log.info("%s: the picture weights are low-rank updates over the text weights' blocks", name)


def use_weight_arithmetic(runners: list[Runner], name: str, options: LoadOptions) -> None:
    """`--weight-arithmetic integer`: the fast path's products over GGUF blocks (engine/packed.py)
    multiply int8 rows (engine/fast_blocks.h). Refused where the text runner reads no weight from
    blocks (no GGUF-block weights, another --quantization, or no compiled fast path), naming why."""
    flag = f"--weight-arithmetic {options.weight_arithmetic}"
    if options.quantization in FAST_QUANTIZATIONS:
        raise LoadError(f"{flag} multiplies weights kept in GGUF blocks; --quantization {options.quantization} "
                        "replaces them: use one of the two")
    fast = runners[0].fast
    if fast is None or fast.stack.native is None:
        why = runners[0].fast_fallback if fast is None else fast_native.unavailable()
        raise LoadError(f"{flag} needs the compiled fast decode path, which {name!r} does not run ({why}); "
                        "use --weight-arithmetic float")
    if fast.packed_bytes == 0:
        raise LoadError(f"{flag}: no weight of {name!r} is kept in GGUF blocks (engine/packed.py: float32 weights "
                        "a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks gave, with VLM_PACKED_WEIGHTS not 0); "
                        "use --weight-arithmetic float")
    for runner in runners:
        if runner.fast is not None:
            runner.fast.use_weight_arithmetic(options.weight_arithmetic)
    log.info("%s: %.1f MB of GGUF blocks multiplied by int8 rows (engine/fast_blocks.h, the %s kernel)", name,
             fast.packed_bytes / 1e6, fast.stack.native.integer_rows_kernels_built()[0])


def quantize_fast(runner: Runner, name: str, quantization: str = "int8") -> None:
    """`--quantization int8`: the fast path's decode and verify passes read int8 weights
    (engine/quantized.py, Int8Weight); `w8a8`: int8 activations too (W8A8Weight); `q4_0`:
    llama.cpp's Q4_0 weights times int8 activations (Q4Weight); prefill keeps the model's own.
    Refused where the fast path does not cover the model; where the int8 activations' fast kernel
    cannot run, said on the log, with the reason."""
    flag = f"--quantization {quantization}"
    if runner.fast is None:
        raise LoadError(f"{flag} needs the fast decode path, which does not cover {name!r} "
                        f"({runner.fast_fallback}); use --quantization 8bit or 4bit (bitsandbytes) or none")
    try:
        runner.fast.quantize(quantization)
    except ValueError as error:
        raise LoadError(f"{flag} on {name!r}: {error}; use --dtype float32 or none") from None
    slow = quantization != "int8" and int8_activations_slow(runner.fast.stack.native)
    if slow:
        log.warning("%s: %s", flag, slow)


def int8_activations_slow(native) -> str | None:
    """Why int8 activations' products run slower than AVX512-VNNI's here (None when they do not):
    the same results either way (integer sums), from a portable loop or the Python reference."""
    if native is None:
        return (f"the compiled decode path is unavailable ({fast_native.unavailable()}): the Python reference "
                "computes the int8 products (float64 matrix products), the same results, several times slower")
    if native.int8_kernel() != "avx512-vnni":
        reason = native.int8_fallback_reason() or f"the {native.int8_kernel()} kernel was chosen"
        return f"{reason}: a portable integer loop computes the int8 products, the same results, slower"
    return None
