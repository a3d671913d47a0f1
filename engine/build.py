"""One way to build an engine, and one set of model and load flags, for every command (the app,
`python -m engine`, the evaluation, the benchmark, the profiler):

    parser = argparse.ArgumentParser()
    add_model_flags(parser)          # --preset --model --drafter --dtype ... (engine/load_settings.py),
                                     # same defaults everywhere
    spec = spec_from_args(parser.parse_args())
    engine = build_engine(spec)      # drafters keyed "text", "vlm", "ngram", "mtp", ...

The app gives every flag an environment variable (`add_model_flags(parser, os.environ)`), for
Spaces, where there are no flags.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field, replace

from engine.drafters.base import Drafter
from engine.drafters.registry import load_drafter
from engine.engine import AUTO, Engine
from engine.load_settings import CPU_IMAGE_TOKENS, LoadSettings, add_model_flags  # noqa: F401 (every command imports it here)
from engine.settings import MAX_COUNT, MAX_COUNT_TEXT
from engine.target import load_target
from models.loading import LoadError, LoadOptions, fitted_options, resolve_device
from models.presets import DEFAULT_PRESET, PRESETS, assembled, resolve

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
    running_requests: int = LoadSettings.running_requests  # the most answers decoded together (engine/worker.py)


def spec_from_args(args: argparse.Namespace, max_images: int = 8) -> EngineSpec:
    """The models the flags name, the preset resolved (models.presets.resolve), and the options."""
    try:
        target, names = resolve(args.preset, args.model, args.drafter)
        auto = AUTO in names  # every other named drafter (or the preset's) is loaded to choose from
        if auto:
            names = [name for name in names if name != AUTO] or resolve(args.preset, args.model, None)[1]
    except ValueError as error:
        raise LoadError(str(error)) from None
    preset = None if args.model else (args.preset or DEFAULT_PRESET)
    arithmetic = args.weight_arithmetic or preset_arithmetic(preset, args)
    options = LoadOptions(dtype=args.dtype, device=args.device, quantization=args.quantization,
                          weight_arithmetic=arithmetic,
                          trust_remote_code=args.trust_remote_code, drafter_dtype=args.drafter_dtype)
    return EngineSpec(target, tuple(names), options, preset, max_images,
                      image_token_budget(getattr(args, "max_image_tokens", None), options), auto,
                      getattr(args, "running_requests", LoadSettings.running_requests))


def preset_arithmetic(preset: str | None, args: argparse.Namespace) -> str:
    """--weight-arithmetic not given: the preset's, where no --quantization replaces the blocks and the
    compiled CPU path that multiplies them runs (else float rows, said on stderr: the preset still
    loads on a GPU, or without a compiler); float rows for --model."""
    wanted = PRESETS[preset].weight_arithmetic if preset and not args.quantization else "float"
    if wanted == "float":
        return wanted
    import torch

    from engine import fast_native

    why = ("its model runs on the GPU" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
           else fast_native.unavailable())
    if why:
        print(f"the {preset!r} preset's {wanted} rows need the compiled CPU path ({why}): float rows instead",
              file=sys.stderr)
        return "float"
    return wanted


def image_token_budget(flag: int | None, options: LoadOptions) -> int | None:
    """--max-image-tokens as the engine takes it: 0 means the processor's own limit (None); not
    given, CPU_IMAGE_TOKENS on a CPU and the processor's own limit on a GPU."""
    if flag is None:
        return CPU_IMAGE_TOKENS if resolve_device(options.device) == "cpu" else None
    if not 0 <= flag <= MAX_COUNT:
        raise LoadError(f"--max-image-tokens {flag}: use 0 (the processor's own limit) or a positive number up to "
                        f"{MAX_COUNT_TEXT}"[:200])
    return flag or None


def with_assembled_target(spec: EngineSpec) -> EngineSpec:
    """`spec` with the smol demo's folder for its target (fetched and assembled the first time)."""
    return replace(spec, target=assembled(spec.target))


def build_engine(spec: EngineSpec) -> Engine:
    """The target and every drafter of the spec, keyed by short names ("text", "vlm", "ngram",
    "mtp", "dflash", "assistant"; "text2" for a second text LM). A preset's drafter folder that is
    missing on disk is skipped with a warning; anything else that cannot load raises LoadError.
    The smol demo's target is assembled here on its first load (models/demo/smol.py), then cached."""
    spec = with_assembled_target(spec)
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
                  auto=spec.auto, running_requests=spec.running_requests)


def drafter_key(drafter: Drafter, taken: dict) -> str:
    key = base = DRAFTER_KEYS.get(drafter.kind, drafter.kind)
    suffix = 2
    while key in taken:
        key, suffix = f"{base}{suffix}", suffix + 1
    return key


def _looks_local(name: str) -> bool:
    """A path rather than a hub id ("owner/name")."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.path.isabs(name)
