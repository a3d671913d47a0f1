"""Loading targets and drafters through transformers' Auto classes (hub ids and local folders alike).

Checks happen here, loudly, before any decoding: the target's family is supported, the
drafter's vocabulary agrees with the target's on the ids they share, safetensors only,
remote code only when asked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from engine.drafters.dflash import DFlashDrafter
from engine.drafters.model import ModelDrafter
from engine.drafters.mtp import MtpDrafter
from engine.drafters.ngram import NgramDrafter
from engine.drafters.shared_cache import SharedCacheDrafter
from engine.hybrid import HybridRunner, has_linear_attention
from engine.runner import Runner
from models.families import TEXT_LM, Family, family_for_config
from models.processors import image_token_ids, load_processor


class LoadError(ValueError):
    """A model could not be loaded; the message says why and which flag fixes it."""


@dataclass
class LoadOptions:
    dtype: str = "auto"  # float32 | bfloat16 | float16 | auto
    device: str = "auto"  # cpu | cuda | auto
    quantization: str | None = None  # None | "4bit" | "8bit" (bitsandbytes)
    trust_remote_code: bool = False
    # Dtype of a drafter that is its own language model (text LM or VLM). "auto": float32 on a
    # CPU for drafters under SMALL_DRAFTER_PARAMETERS (a CPU's bfloat16 matmul has a fixed cost
    # that dominates a small model's decode step; see the README's Benchmark), else `dtype`.
    # The target verifies every token, so a drafter's dtype never changes the answer.
    drafter_dtype: str = "auto"


SMALL_DRAFTER_PARAMETERS = 1_000_000_000


@dataclass
class Target:
    name: str
    model: torch.nn.Module
    processor: object
    family: Family
    runner: Runner
    placeholder_ids: frozenset[int]

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise LoadError("--device cuda was asked for but no CUDA device is available; use --device cpu")
    return device


def _model_kwargs(options: LoadOptions) -> dict:
    dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if options.dtype not in dtype:
        raise LoadError(f"unknown dtype {options.dtype!r}; use one of {', '.join(dtype)}")
    device = resolve_device(options.device)
    kwargs = {"dtype": dtype[options.dtype], "use_safetensors": True, "trust_remote_code": options.trust_remote_code}
    if options.quantization:
        from transformers import BitsAndBytesConfig

        if options.quantization not in ("4bit", "8bit"):
            raise LoadError(f"unknown quantization {options.quantization!r}; use 4bit or 8bit")
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=options.quantization == "4bit", load_in_8bit=options.quantization == "8bit")
    # accelerate's device_map spreads a target larger than one GPU over the available ones.
    kwargs["device_map"] = "auto" if options.device == "auto" and device == "cuda" else device
    return kwargs


def _from_pretrained(model_class, name: str, kwargs: dict):
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


def _load_config(name: str, options: LoadOptions):
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=options.trust_remote_code)
    except OSError as error:
        where = "folder" if os.path.isdir(name) else "hub id (offline? set HF_HUB_OFFLINE=0 and check the network)"
        raise LoadError(f"cannot load model {name!r} as a {where}: {str(error).splitlines()[0]}") from error
    except ValueError as error:
        if "trust_remote_code" in str(error):
            raise LoadError(f"{name!r} needs its own code; pass --trust-remote-code if you trust it") from error
        raise LoadError(f"cannot read the config of {name!r}: {error}") from error


def _family(config) -> Family:
    try:
        return family_for_config(config)
    except ValueError as error:
        raise LoadError(str(error)) from None


def _load_processor(name: str, options: LoadOptions):
    try:
        return load_processor(name, trust_remote_code=options.trust_remote_code)
    except ValueError as error:
        raise LoadError(str(error)) from None


def load_target(name: str, options: LoadOptions | None = None) -> Target:
    options = options or LoadOptions()
    config = _load_config(name, options)
    if not hasattr(config, "vision_config"):
        raise LoadError(f"{name!r} is a {config.model_type!r} model without a vision tower; --model needs a "
                        "vision-language model (a text-only model can be a --drafter)")
    family = _family(config)
    model = _from_pretrained(AutoModelForImageTextToText, name, _model_kwargs(options))
    processor = _load_processor(name, options)
    runner = (HybridRunner if has_linear_attention(config) else Runner)(model, family)
    return Target(name, model, processor, family, runner, frozenset(image_token_ids(processor)))


def load_drafter(name: str | None, target: Target, options: LoadOptions | None = None):
    """`ngram`, `mtp` (the target's own MTP layers), a DFlash or shared-cache assistant folder
    (recognized by its config), a text-only causal LM, or a VLM of the target's family; None for
    plain decoding."""
    if name in (None, "", "none"):
        return None
    if name == "ngram":
        return NgramDrafter()
    if name == "mtp":
        return load_mtp_drafter(target)
    options = options or LoadOptions()
    config = _load_config(name, options)
    kwargs = _model_kwargs(options)
    if has_linear_attention(config):
        raise LoadError(f"drafter {name!r} has linear-attention layers, whose recurrent state a drafter's rollback "
                        "cannot rewind; use a drafter with attention layers only, or --drafter ngram")
    if is_dflash_assistant(config):
        return load_dflash_drafter(name, config, target, kwargs)
    if is_shared_cache_assistant(config):
        return load_shared_cache_drafter(name, config, target, kwargs)
    if options.drafter_dtype != "auto":  # drafters that read the target keep the target's dtype
        kwargs = _model_kwargs(replace(options, dtype=options.drafter_dtype))
    if hasattr(config, "vision_config"):
        family = _family(config)
        if family.name != target.family.name:
            raise LoadError(f"VLM drafter {name!r} is {family.name}, the target is {target.family.name}; a VLM "
                            "drafter must be of the target's family (or use a text-only LM or --drafter ngram)")
        model = _from_pretrained(AutoModelForImageTextToText, name, kwargs)
        encoder = _load_processor(name, options)
        tokenizer, kind = encoder.tokenizer, "vlm"
    else:
        model = _from_pretrained(AutoModelForCausalLM, name, kwargs)
        encoder = tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=options.trust_remote_code)
        family, kind = TEXT_LM, "text_lm"
    check_vocabularies(target.tokenizer, tokenizer, name)
    model = _drafter_dtype(model, options)
    text_config = model.config.get_text_config()
    max_positions = getattr(text_config, "max_position_embeddings", None)
    runner = Runner(model, family, vocab_size=target.vocab_size)
    return ModelDrafter(name, kind, runner, encoder, max_positions)


def _drafter_dtype(model, options: LoadOptions):
    """`drafter_dtype` "auto": a small drafter on a CPU runs in float32 (see LoadOptions)."""
    small = sum(p.numel() for p in model.parameters()) < SMALL_DRAFTER_PARAMETERS
    if options.drafter_dtype == "auto" and model.device.type == "cpu" and small and not options.quantization:
        return model.float()
    return model


def load_mtp_drafter(target: Target) -> MtpDrafter:
    """The MTP layers of the target's own checkpoint (read again from its folder or hub id)."""
    from transformers.modeling_layers import MtpModel

    text_config = target.model.config.get_text_config()
    if not getattr(text_config, "num_mtp_layers", None):
        raise LoadError(f"--drafter mtp: {target.name!r} ({text_config.model_type}) declares no MTP layers "
                        "(num_mtp_layers / num_nextn_predict_layers); pick another drafter")
    try:
        mtp = MtpModel.from_pretrained(target.model, device_map={"": target.model.device}).eval()
    except (OSError, RuntimeError, ValueError) as error:
        raise LoadError(f"--drafter mtp: cannot read the MTP layers of {target.name!r}: {error}") from error
    return MtpDrafter("mtp", mtp, target.model, target.family)


def is_dflash_assistant(config) -> bool:
    """A DFlash block drafter's config names the target layers it reads and its block size."""
    return getattr(config, "target_layer_ids", None) is not None and getattr(config, "block_size", None) is not None


def load_dflash_drafter(name: str, config, target: Target, kwargs: dict) -> DFlashDrafter:
    text_config = target.model.config.get_text_config()
    problems = []
    if max(config.target_layer_ids) >= text_config.num_hidden_layers:
        problems.append(f"it reads target layers {config.target_layer_ids}, the target has {text_config.num_hidden_layers}")
    if config.hidden_size != text_config.hidden_size:
        problems.append(f"its hidden size is {config.hidden_size}, the target's {text_config.hidden_size}")
    if config.mask_token_id >= target.vocab_size:
        problems.append(f"its mask token {config.mask_token_id} is outside the target's vocabulary of {target.vocab_size}")
    if target.family.positions(0, 1, "cpu").dim() != 2:
        problems.append(f"its rotary embedding is 1-axis, the target ({target.family.name}) numbers positions "
                        "on three M-RoPE rows")
    if problems:
        raise LoadError(f"DFlash drafter {name!r} ({config.model_type}) does not fit the target {target.name!r}: "
                        + "; ".join(problems) + ". Use the assistant trained for this target.")
    from transformers import AutoModel

    return DFlashDrafter(name, _from_pretrained(AutoModel, name, kwargs), target.model, target.family)


def is_shared_cache_assistant(config) -> bool:
    """An assistant that attends to the target's shared K/V names the target's hidden size."""
    return getattr(config, "backbone_hidden_size", None) is not None


def load_shared_cache_drafter(name: str, config, target: Target, kwargs: dict) -> SharedCacheDrafter:
    text_config = target.model.config.get_text_config()
    stores = set(getattr(text_config, "kv_sharing_modes", None) or ())
    problems = []
    if "store" not in stores:
        problems.append(f"the target ({target.family.name}) shares no K/V between layers")
    if config.backbone_hidden_size != text_config.hidden_size:
        problems.append(f"it was trained on a target of hidden size {config.backbone_hidden_size}, "
                        f"the target's is {text_config.hidden_size}")
    if config.get_text_config().vocab_size < target.vocab_size:
        problems.append(f"its vocabulary ({config.get_text_config().vocab_size}) is smaller than the target's")
    if problems:
        raise LoadError(f"assistant {name!r} ({config.model_type}) does not fit the target {target.name!r}: "
                        + "; ".join(problems) + ". Use the assistant released with this target.")
    assistant = _from_pretrained(AutoModelForCausalLM, name, kwargs)
    return SharedCacheDrafter(name, assistant, target.model, target.family)


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
