"""Loading models through transformers' Auto classes (hub ids and local folders alike).

Hugging Face code only: load options, `from_pretrained` with the checks every load needs
(safetensors only, remote code only when asked, errors that say which flag fixes them),
processors, vocabulary checks and the family of a VLM. What the engine builds on top of a
loaded model (runners, drafters) lives in `engine/`.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, replace

import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

from models.families import Family, family_for_config


class LoadError(ValueError):
    """A model could not be loaded; the message says why and which flag fixes it."""


DTYPES = ("fit", "float32", "bfloat16", "float16", "auto")
DRAFTER_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("4bit", "8bit", "int8", "w8a8", "q4_0")  # int8, w8a8, q4_0: the fast decode path's (engine/target.py)
FAST_QUANTIZATIONS = ("int8", "w8a8", "q4_0")


@dataclass(frozen=True)
class LoadOptions:
    """How every model of one engine is loaded; the defaults are every command's defaults."""

    dtype: str = "float32"  # float32 (plain and speculative greedy answers identical) | bfloat16 | float16 | auto
    device: str = "auto"  # cpu | cuda | auto
    quantization: str | None = None  # None | "4bit" | "8bit" (bitsandbytes) | "int8" | "w8a8" | "q4_0" (the fast path's, target only)
    weight_arithmetic: str = "float"  # float | integer: products over GGUF blocks (engine/packed.py ARITHMETICS), target only
    trust_remote_code: bool = False
    # Dtype of a drafter that is its own language model (text LM or VLM). "auto": float32 on a
    # CPU for drafters under SMALL_DRAFTER_PARAMETERS (a CPU's bfloat16 matmul has a fixed cost
    # that dominates a tiny model's decode step), else `dtype`: from tens of millions of
    # parameters up, float32 buys nothing and doubles the memory (the measured figures and their
    # commands: docs/benchmarks.md, "Where a step's time goes"). The target verifies every
    # token, so a drafter's dtype never changes the answer. Drafter modules that read the target
    # (EAGLE-3, MTP, block): engine/drafters/target_head.py `module_dtype`.
    drafter_dtype: str = "auto"


SMALL_DRAFTER_PARAMETERS = 10_000_000
FIT_SHARE = 0.4  # "fit": float32 when the target's float32 weights take at most this share of memory


@dataclass
class LoadedVLM:
    """A vision-language model with its processor, family and image placeholder ids."""

    name: str
    model: torch.nn.Module
    processor: object
    family: Family
    placeholder_ids: frozenset[int]


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise LoadError("--device cuda was asked for but no CUDA device is available; use --device cpu")
    if device != "cpu":
        raise LoadError(f"unknown device {device!r}; use one of {', '.join(DEVICES)}")
    return device


def model_kwargs(options: LoadOptions, dtype: str | None = None) -> dict:
    """`from_pretrained` keyword arguments for these options (`dtype` overrides options.dtype)."""
    dtypes = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    dtype = dtype or options.dtype
    if dtype not in dtypes:
        raise LoadError(f"unknown dtype {dtype!r}; use one of {', '.join(dtypes)}")
    device = resolve_device(options.device)
    kwargs = {"dtype": dtypes[dtype], "use_safetensors": True, "trust_remote_code": options.trust_remote_code}
    if options.quantization:
        if options.quantization not in QUANTIZATIONS:
            raise LoadError(f"unknown quantization {options.quantization!r}; use {', '.join(QUANTIZATIONS)}")
    if options.quantization in ("4bit", "8bit"):
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=options.quantization == "4bit", load_in_8bit=options.quantization == "8bit")
    # accelerate's device_map spreads a target larger than one GPU over the available ones.
    kwargs["device_map"] = "auto" if options.device == "auto" and device == "cuda" else device
    return kwargs


def from_pretrained(model_class, name: str, kwargs: dict):
    """`model_class.from_pretrained(name, **kwargs)` in eval mode; failures become LoadError."""
    try:
        return model_class.from_pretrained(name, **kwargs).eval()
    except ImportError as error:  # bitsandbytes / accelerate missing
        raise LoadError(f"cannot load {name!r}: {str(error).splitlines()[0]} (for --quantization: "
                        "pip install bitsandbytes)") from error
    except OSError as error:
        if "safetensors" in str(error) or ".bin" in str(error):
            raise LoadError(f"{name!r} has no safetensors weights; this app loads safetensors only "
                            "(convert the checkpoint with save_pretrained(safe_serialization=True))") from error
        raise LoadError(f"cannot load the weights of {name!r}: {str(error).splitlines()[0]}") from error


def load_config(name: str, options: LoadOptions):
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=options.trust_remote_code)
    except OSError as error:
        where = "folder" if os.path.isdir(name) else "hub id (offline? set HF_HUB_OFFLINE=0 and check the network)"
        raise LoadError(f"cannot load model {name!r} as a {where}: {str(error).splitlines()[0]}") from error
    except ValueError as error:
        if "trust_remote_code" in str(error):
            raise LoadError(f"{name!r} needs its own code; pass --trust-remote-code if you trust it") from error
        raise LoadError(f"cannot read the config of {name!r}: {error}") from error


def family_of(config) -> Family:
    try:
        return family_for_config(config)
    except ValueError as error:
        raise LoadError(str(error)) from None


def processor_of(name: str, family: Family, options: LoadOptions):
    try:
        return family.load_processor(name, trust_remote_code=options.trust_remote_code)
    except ValueError as error:
        raise LoadError(str(error)) from None


def tokenizer_of(name: str, options: LoadOptions):
    return AutoTokenizer.from_pretrained(name, trust_remote_code=options.trust_remote_code)


def has_linear_attention(config) -> bool:
    """True when the text model has linear-attention (recurrent) layers (Qwen3.5)."""
    return "linear_attention" in recurrent_layer_types(config)


def recurrent_layer_types(config) -> set[str]:
    """The text model's layer types whose cache keeps a convolution or recurrent state, which no
    crop rewinds (the types transformers' DynamicCache gives a linear-attention cache layer)."""
    layer_types = getattr(config.get_text_config(), "layer_types", None) or ()
    return set(layer_types) & {"linear_attention", "conv", "hybrid", "hybrid_sliding"}


def load_vlm(name: str, options: LoadOptions, config=None, dtype: str | None = None) -> LoadedVLM:
    """A supported vision-language model, its processor and its image placeholder ids."""
    config = config or load_config(name, options)
    if not hasattr(config, "vision_config"):
        raise LoadError(f"{name!r} is a {config.model_type!r} model without a vision tower; --model needs a "
                        "vision-language model (a text-only model can be a --drafter)")
    family = family_of(config)
    model = from_pretrained(AutoModelForImageTextToText, name, model_kwargs(options, dtype))
    processor = processor_of(name, family, options)
    return LoadedVLM(name, model, processor, family, frozenset(family.placeholder_ids(processor)))


def copy_out_of_weight_files(modules: list[torch.nn.Module]) -> int:
    """The parameters and buffers of `modules` that still lie in a mapped `.safetensors` file
    (transformers maps it and hands out views of it) copied to memory of their own, where they
    are at most a quarter of that file: then the file's mapping, whose pages reading the weights
    made resident, goes with its last tensor. For after the runners have copied what they read
    (engine/target.py): the smol demo's vision merger, 4 MB, held its 517 MB file resident. A
    file whose tensors are mostly still in use stays mapped (a copy would only double the peak).
    Returns the bytes copied; where /proc/self/maps is missing (not Linux), none."""
    ranges = weight_file_ranges()
    found: list[tuple[dict, str, torch.Tensor, int]] = []  # (the module's table, key, tensor, its file's range)
    views: dict[tuple, int] = {}  # each distinct view's bytes, once, by (its file's range, address, shape...)
    for module in {id(module): module for module in modules}.values():
        for owner in module.modules():
            for table in (owner._parameters, owner._buffers):
                for key, tensor in table.items():
                    at = _range_of(tensor, ranges) if tensor is not None else None
                    if at is not None:
                        found.append((table, key, tensor, at))
                        views[(at, *_view(tensor))] = tensor.nbytes
    held = collections.Counter()
    for (at, *_), size in views.items():
        held[at] += size
    copies: dict[tuple, torch.Tensor] = {}  # one copy of a view several modules share
    for table, key, tensor, at in found:
        start, end = ranges[at]
        if held[at] * 4 > end - start:
            continue
        if _view(tensor) not in copies:
            copies[_view(tensor)] = tensor.detach().clone()
        copy = copies[_view(tensor)]
        if isinstance(tensor, torch.nn.Parameter):
            tensor.data = copy  # the parameter object stays (tied weights, optimizers' references)
        else:
            table[key] = copy
    return sum(copy.nbytes for copy in copies.values())


def weight_file_ranges(maps: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """(start, end) of each mapping of a `.safetensors` file in this process; none where `maps` is missing."""
    try:
        with open(maps) as lines:
            return [tuple(int(end, 16) for end in line.split()[0].split("-")) for line in lines
                    if line.rstrip().endswith(".safetensors")]
    except OSError:
        return []


def _range_of(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> int | None:
    if tensor.device.type != "cpu":
        return None
    return next((at for at, (start, end) in enumerate(ranges) if start <= tensor.data_ptr() < end), None)


def _view(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype


def fit_dtype(parameters: int, memory_bytes: int) -> tuple[str, str]:
    """`--dtype fit`: float32 (plain and speculative greedy answers identical) when the weights
    take at most FIT_SHARE of the memory in float32, else bfloat16; and why."""
    need, have = 4 * parameters / 1e9, memory_bytes / 1e9
    if 4 * parameters <= FIT_SHARE * memory_bytes:
        return "float32", f"float32: {parameters / 1e9:.2f} B parameters take {need:.1f} GB, within " \
                          f"{FIT_SHARE:.0%} of {have:.1f} GB"
    return "bfloat16", f"bfloat16: {parameters / 1e9:.2f} B parameters would take {need:.1f} GB in float32, over " \
                       f"{FIT_SHARE:.0%} of {have:.1f} GB (--dtype float32 insists)"


def fitted_options(name: str, options: LoadOptions) -> tuple[LoadOptions, str | None]:
    """Options with `dtype` "fit" resolved for target `name` (its parameters counted on the meta
    device from its config; the memory of the device it loads on), and the reason when that is
    not float32 (None when the dtype was given, or float32)."""
    if options.dtype != "fit":
        return options, None
    config = load_config(name, options)
    try:
        with torch.device("meta"):
            parameters = sum(p.numel() for p in AutoModelForImageTextToText.from_config(config).parameters())
    except ValueError:  # not a VLM: loading it says so
        return replace(options, dtype="float32"), None
    if resolve_device(options.device) == "cuda":
        memory = torch.cuda.get_device_properties(0).total_memory
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    dtype, reason = fit_dtype(parameters, memory)
    return replace(options, dtype=dtype), reason if dtype != "float32" else None


def dtype_name(model) -> str:
    """The dtype a loaded model runs in: "float32", "bfloat16", ..."""
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def small_drafter_dtype(model, options: LoadOptions):
    """`drafter_dtype` "auto": a small drafter on a CPU runs in float32 (see LoadOptions)."""
    small = sum(p.numel() for p in model.parameters()) < SMALL_DRAFTER_PARAMETERS
    if options.drafter_dtype == "auto" and model.device.type == "cpu" and small and \
            options.quantization in (None, *FAST_QUANTIZATIONS):  # bitsandbytes weights cannot be cast
        return model.float()
    return model


def drafter_options(options: LoadOptions) -> LoadOptions:
    """Options for a drafter that is its own language model: `drafter_dtype` unless "auto"."""
    return options if options.drafter_dtype == "auto" else replace(options, dtype=options.drafter_dtype)


def check_vocabularies(target_tokenizer, drafter_tokenizer, drafter_name: str) -> None:
    """Refuse a drafter whose ids mean other tokens than the target's.

    Vocabulary sizes often differ by padding rows or image tokens (Qwen2.5-VL-7B: 152064
    rows, Qwen2.5-0.5B: 151936), so only the tokens both tokenizers have are compared.
    """
    target_vocab = target_tokenizer.get_vocab()
    drafter_vocab = drafter_tokenizer.get_vocab()
    shared = target_vocab.keys() & drafter_vocab.keys()
    mismatched = [t for t in shared if target_vocab[t] != drafter_vocab[t]]
    coverage = len(shared) / max(len(drafter_vocab), 1)
    if mismatched or coverage < 0.9:
        example = f" (e.g. {mismatched[0]!r}: target id {target_vocab[mismatched[0]]}, drafter id " \
                  f"{drafter_vocab[mismatched[0]]})" if mismatched else ""
        raise LoadError(
            f"drafter {drafter_name!r} does not share the target's vocabulary: {len(mismatched)} of {len(shared)} "
            f"shared tokens have other ids{example}, and {coverage:.0%} of the drafter's tokens exist in the "
            "target's. Use a drafter trained with the target's tokenizer (e.g. Qwen2.5-0.5B-Instruct for "
            "Qwen2.5-VL, SmolLM2-135M-Instruct for SmolVLM), or --drafter ngram, which works with any target.")
