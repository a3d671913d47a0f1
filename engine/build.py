"""One way to build an engine, and one set of model and load flags, for every command (the app,
`python -m engine`, the evaluation, the benchmark, the profiler):

    parser = argparse.ArgumentParser()
    add_model_flags(parser)          # --preset --model --drafter --dtype --drafter-dtype --device
                                     # --quantization --trust-remote-code, same defaults everywhere
    spec = spec_from_args(parser.parse_args())
    engine = build_engine(spec)      # drafters keyed "text", "vlm", "ngram", "mtp", ...

The app gives every flag an environment variable (`env=`), for Spaces, where there are no flags.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.drafters.base import Drafter
from engine.drafters.registry import load_drafter
from engine.engine import AUTO, Engine
from engine.settings import flag
from engine.target import load_target
from models.loading import (DEVICES, DRAFTER_DTYPES, DTYPES, QUANTIZATIONS, LoadError, LoadOptions, fitted_options,
                            resolve_device)
from models.presets import PRESETS, resolve

TRUE = ("1", "true", "yes", "on")
# The default budget of tokens per image on a CPU; on a GPU the processor's own limit. A phone photo at a
# processor's own limit is minutes of prefill on a CPU (docs/realscale.md has the measured figures).
CPU_IMAGE_TOKENS = 384
DRAFTER_KEYS = {"text_lm": "text", "vlm": "vlm", "shared_cache": "assistant"}  # else the kind itself


@dataclass(frozen=True)
class EngineSpec:
    """What to load: a target, its drafters (the first is the default), and how."""

    target: str
    drafters: tuple[str, ...] = ()
    options: LoadOptions = field(default_factory=LoadOptions)
    preset: str | None = None  # set when the models came from a preset (not --model)
    max_images: int = 8
    max_image_tokens: int | None = CPU_IMAGE_TOKENS  # each image's budget of tokens; None: the processor's own
    auto: bool = False  # `--drafter auto`: each request picks among the drafters (engine/auto.py)


def add_model_flags(parser: argparse.ArgumentParser, env: Callable[[str], str | None] = lambda name: None) -> None:
    """The model and load flags; `env(NAME)` gives a flag's default (the app reads VLM_NAME)."""
    def flag_default(name: str, default=None):
        return env(name) or default

    parser.add_argument("--preset", default=flag_default("PRESET"), choices=sorted(PRESETS),
                        help=f"a named target and drafters: {', '.join(PRESETS)} (default: demo, the bundled model)")
    parser.add_argument("--model", default=flag_default("MODEL"),
                        help="hub id or local folder of the target VLM (default: the preset's)")
    parser.add_argument("--drafter", action="append", default=None,
                        help="a drafter: hub id or folder (text LM, VLM of the target's family, DFlash or Gemma 4 "
                             "assistant), 'ngram', 'mtp' (the target's own MTP layers), 'auto' (load the others, "
                             "or the preset's, and pick one per request by measured speed) or 'none'; repeat, or "
                             "separate with commas (default: the preset's; ngram with --model)")
    parser.add_argument("--dtype", default=flag_default("DTYPE", "fit"), choices=DTYPES,
                        help='the target\'s dtype; "fit" (default): float32 (plain and speculative greedy answers '
                             'identical) when its float32 weights take at most 40%% of the memory, else bfloat16')
    parser.add_argument("--drafter-dtype", default=flag_default("DRAFTER_DTYPE", LoadOptions.drafter_dtype),
                        choices=DRAFTER_DTYPES,
                        help='"auto" (default): float32 on a CPU for drafters under 10M parameters, else --dtype')
    parser.add_argument("--device", default=flag_default("DEVICE", LoadOptions.device), choices=DEVICES,
                        help='where the models run; "auto" (default): cuda when there is one, else cpu')
    parser.add_argument("--quantization", default=flag_default("QUANTIZATION"), choices=QUANTIZATIONS,
                        help="4bit / 8bit: load the target in 4 or 8 bits (bitsandbytes); int8: the fast "
                             "decode path reads int8 copies of the target's text weights (docs/performance.md)")
    parser.add_argument(flag("max_image_tokens"), type=int, default=_int_or_none(flag_default("MAX_IMAGE_TOKENS")),
                        metavar="N", help=f"the default of the setting max_image_tokens: at most about this many "
                                          f"tokens per image (0: the model's processor's own limit; default: "
                                          f"{CPU_IMAGE_TOKENS} on a CPU, the processor's own on a GPU)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        default=(flag_default("TRUST_REMOTE_CODE", "")).lower() in TRUE,
                        help="run a checkpoint's own Python code (off: such a model is refused, naming this flag)")
    parser.set_defaults(drafter_env=env("DRAFTER"))


def spec_from_args(args: argparse.Namespace, max_images: int = 8) -> EngineSpec:
    """The models the flags name, the preset resolved (models.presets.resolve), and the options."""
    drafters = args.drafter or ([args.drafter_env] if getattr(args, "drafter_env", None) else None)
    try:
        target, names = resolve(args.preset, args.model, drafters)
        auto = AUTO in names  # every other named drafter (or the preset's) is loaded to choose from
        if auto:
            names = [name for name in names if name != AUTO] or resolve(args.preset, args.model, None)[1]
    except ValueError as error:
        raise LoadError(str(error)) from None
    options = LoadOptions(dtype=args.dtype, device=args.device, quantization=args.quantization,
                          trust_remote_code=args.trust_remote_code, drafter_dtype=args.drafter_dtype)
    return EngineSpec(target, tuple(names), options, None if args.model else (args.preset or "demo"), max_images,
                      image_token_budget(getattr(args, "max_image_tokens", None), options), auto)


def image_token_budget(flag: int | None, options: LoadOptions) -> int | None:
    """--max-image-tokens as the engine takes it: 0 means the processor's own limit (None); not
    given, CPU_IMAGE_TOKENS on a CPU and the processor's own limit on a GPU."""
    if flag is None:
        return CPU_IMAGE_TOKENS if resolve_device(options.device) == "cpu" else None
    if flag < 0:
        raise LoadError(f"--max-image-tokens {flag}: use 0 (the processor's own limit) or a positive number")
    return flag or None


def _int_or_none(value: str | None) -> int | None:
    try:
        return None if value in (None, "") else int(value)
    except ValueError:
        raise LoadError(f"VLM_MAX_IMAGE_TOKENS: {value!r} is not a whole number") from None


def build_engine(spec: EngineSpec) -> Engine:
    """The target and every drafter of the spec, keyed by short names ("text", "vlm", "ngram",
    "mtp", "dflash", "assistant"; "text2" for a second text LM). A preset's drafter folder that is
    missing on disk is skipped with a warning; anything else that cannot load raises LoadError."""
    if _looks_local(spec.target) and not os.path.isdir(spec.target):
        if spec.preset:
            raise LoadError(f"the {spec.preset!r} preset's model is not in {spec.target} (the bundled demo model is "
                            "trained by `bash scripts/train_demo.sh`); or pass --model DIR_OR_HUB_ID")
        raise LoadError(f"--model {spec.target}: no such folder")
    options, reason = fitted_options(spec.target, spec.options)
    if reason:
        print(f"dtype {reason}", file=sys.stderr)
    target = load_target(spec.target, options)
    drafters: dict[str, Drafter] = {}
    for name in spec.drafters:
        if spec.preset and _looks_local(name) and not os.path.isdir(name):
            print(f"warning: skipping the preset's drafter {name}: not on disk", file=sys.stderr)
            continue
        drafter = load_drafter(name, target, options)
        drafters[drafter_key(drafter, drafters)] = drafter
    return Engine(target, drafters, max_images=spec.max_images, max_image_tokens=spec.max_image_tokens,
                  auto=spec.auto)


def drafter_key(drafter: Drafter, taken: dict) -> str:
    key = base = DRAFTER_KEYS.get(drafter.kind, drafter.kind)
    suffix = 2
    while key in taken:
        key, suffix = f"{base}{suffix}", suffix + 1
    return key


def _looks_local(name: str) -> bool:
    """A path rather than a hub id ("owner/name")."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.path.isabs(name)
