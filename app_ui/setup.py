"""Configuration from flags and environment variables, and the engine built from it.

Every flag has an environment variable (for Hugging Face Spaces, where there are no flags);
a flag wins over its variable:

    --preset   VLM_PRESET    named target + drafters (default: demo, the bundled model)
    --model    VLM_MODEL     target VLM: hub id or folder (overrides the preset's)
    --drafter  VLM_DRAFTER   drafter: hub id, folder, "ngram" or "none"; repeat the flag, or
                             separate with commas (default: the preset's, or ngram with --model)
    --dtype    VLM_DTYPE     float32 (default, exact A/B), bfloat16, float16, auto
    --device   VLM_DEVICE    auto (default), cpu, cuda
    --drafter-dtype  VLM_DRAFTER_DTYPE  auto (default: float32 on a CPU for drafters under 1B
                             parameters, else --dtype), float32, bfloat16, float16
    --host     VLM_HOST      default 127.0.0.1 (0.0.0.0 on a Space)
    --port     VLM_PORT      default 7860, or the next free port
    --share    VLM_SHARE=1   a public gradio.live link
    --no-browser  VLM_NO_BROWSER=1   do not open the browser (never opened on a Space)
    --max-images  VLM_MAX_IMAGES     images per conversation (default 8, at most 64)
    --trust-remote-code  VLM_TRUST_REMOTE_CODE=1   run a checkpoint's own Python code (off: such a
                             model is refused with a message naming this flag)

A bad value, of a flag or a variable, raises SetupError naming it (app.py prints one line).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from PIL import Image

from models.presets import PRESETS

TRUE = ("1", "true", "yes", "on")


class SetupError(Exception):
    """The app cannot start; the message (one line) says why and what to do."""


@dataclass
class Config:
    model: str
    drafters: list[str]
    dtype: str = "float32"
    device: str = "auto"
    drafter_dtype: str = "auto"
    host: str = "127.0.0.1"
    port: int | None = None
    share: bool = False
    open_browser: bool = True
    max_images: int = 8
    preset: str | None = None  # a preset whose model is a local folder (the bundled demo), else None
    trust_remote_code: bool = False
    behind_proxy: bool = False  # on a Space: a client's address is the first of X-Forwarded-For


def read_config(argv: list[str] | None = None, environ=os.environ) -> Config:
    """The app's settings: flags, else VLM_* variables, else defaults. A bad flag or variable
    raises SetupError naming it (one line); --help prints the usage and exits."""
    on_space = bool(environ.get("SPACE_ID"))

    def env(name: str, default=None):
        return environ.get(f"VLM_{name}") or default

    parser = _Parser(prog="python app.py", description="Chat with a VLM; speculative decoding.")
    parser.add_argument("--preset", type=_choice("--preset", sorted(PRESETS)))
    parser.add_argument("--model")
    parser.add_argument("--drafter", action="append", default=None)
    parser.add_argument("--dtype", type=_choice("--dtype", DTYPES))
    parser.add_argument("--device", type=_choice("--device", DEVICES))
    parser.add_argument("--drafter-dtype", type=_choice("--drafter-dtype", DRAFTER_DTYPES))
    parser.add_argument("--host")
    parser.add_argument("--port", type=_whole("--port", 1, 65535))
    parser.add_argument("--share", action="store_true", default=env("SHARE", "").lower() in TRUE)
    parser.add_argument("--no-browser", action="store_true", default=on_space or env("NO_BROWSER", "").lower() in TRUE)
    parser.add_argument("--max-images", type=_whole("--max-images", 1, MAX_IMAGES))
    parser.add_argument("--trust-remote-code", action="store_true",
                        default=env("TRUST_REMOTE_CODE", "").lower() in TRUE)
    args = parser.parse_args(argv)

    def setting(flag_value, name: str, parser, default):
        """The flag, else the variable VLM_<name> read by `parser(its name)`, else `default`."""
        if flag_value is not None:
            return flag_value
        value = env(name)
        return default if value is None else parser(f"VLM_{name}")(value)

    port_variable = env("PORT") or environ.get("GRADIO_SERVER_PORT")
    port = args.port if args.port is not None else (
        _whole("VLM_PORT", 1, 65535)(port_variable) if port_variable else None)
    preset_name = setting(args.preset, "PRESET", lambda name: _choice(name, sorted(PRESETS)), None)
    drafters = [name.strip() for value in (args.drafter or [env("DRAFTER", "")]) for name in value.split(",")]
    drafters = [name for name in drafters if name]
    model = args.model or env("MODEL")
    if model:
        drafters = drafters or ["ngram"]
    else:
        preset = PRESETS[preset_name or "demo"]
        model, drafters = preset.target, drafters or list(preset.drafters)
    if "none" in drafters:
        drafters = []
    elif "ngram" not in drafters:
        drafters.append("ngram")  # costs nothing and works with any target
    local_preset = None if args.model or env("MODEL") or not os.path.isabs(model) else (preset_name or "demo")
    return Config(
        model, drafters,
        dtype=setting(args.dtype, "DTYPE", lambda name: _choice(name, DTYPES), "float32"),
        device=setting(args.device, "DEVICE", lambda name: _choice(name, DEVICES), "auto"),
        drafter_dtype=setting(args.drafter_dtype, "DRAFTER_DTYPE", lambda name: _choice(name, DRAFTER_DTYPES), "auto"),
        host=args.host or env("HOST", environ.get("GRADIO_SERVER_NAME") or ("0.0.0.0" if on_space else "127.0.0.1")),
        port=port, share=args.share, open_browser=not args.no_browser,
        max_images=setting(args.max_images, "MAX_IMAGES", lambda name: _whole(name, 1, MAX_IMAGES), 8),
        preset=local_preset,  # the bundled model's folder must exist; hub presets load like --model
        trust_remote_code=args.trust_remote_code, behind_proxy=on_space)


DTYPES = ["float32", "bfloat16", "float16", "auto"]
DRAFTER_DTYPES = ["auto", "float32", "bfloat16", "float16"]
DEVICES = ["auto", "cpu", "cuda"]
MAX_IMAGES = 64


class _Parser(argparse.ArgumentParser):
    """Errors raise SetupError (one line, exit status 1 in app.py) instead of printing the usage."""

    def error(self, message: str):
        raise SetupError(message)


def _choice(name: str, choices: list[str]):
    """A reader of the flag or variable `name` that takes one of `choices`."""
    def parse(value: str) -> str:
        if value not in choices:
            raise SetupError(f"{name}: {value!r} is not one of {', '.join(choices)}")
        return value
    return parse


def _whole(name: str, low: int, high: int):
    """A reader of the flag or variable `name` that takes a whole number from `low` to `high`."""
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise SetupError(f"{name}: {value!r} is not a whole number") from None
        if not low <= number <= high:
            raise SetupError(f"{name}: {number} is not from {low} to {high}")
        return number
    return parse


def load_engine(config: Config):
    """The engine with every drafter of the config, keyed by short names ("text", "vlm",
    "ngram"); a preset's drafter that is missing on disk is skipped with a warning."""
    from engine.engine import Engine
    from models.loading import LoadError, LoadOptions, load_drafter, load_target

    if config.preset and not os.path.isdir(config.model):
        raise SetupError(f"the {config.preset!r} preset's model is not in {config.model} yet (the bundled demo "
                         "model is trained by `python -m models.demo.train --out assets/demo`); "
                         "or pass --model DIR_OR_HUB_ID")
    if _looks_local(config.model) and not os.path.isdir(config.model):
        raise SetupError(f"--model {config.model}: no such folder")
    options = LoadOptions(dtype=config.dtype, device=config.device, trust_remote_code=config.trust_remote_code,
                          drafter_dtype=config.drafter_dtype)
    try:
        target = load_target(config.model, options)
        drafters = {}
        for name in config.drafters:
            if config.preset and name != "ngram" and not os.path.isdir(name):
                print(f"warning: skipping the preset's drafter {name}: not on disk", file=sys.stderr)
                continue
            drafter = load_drafter(name, target, options)
            drafters[_drafter_key(drafter, drafters)] = drafter
    except LoadError as error:
        raise SetupError(str(error)) from None
    return Engine(target, drafters, max_images=config.max_images)


def _looks_local(name: str) -> bool:
    """A path rather than a hub id ("owner/name")."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def _drafter_key(drafter, taken: dict) -> str:
    key = {"text_lm": "text", "vlm": "vlm"}.get(drafter.kind, drafter.kind)
    suffix = 2
    while key in taken:
        key, suffix = f"{key.rstrip('0123456789')}{suffix}", suffix + 1
    return key


def warm_up(engine) -> None:
    """One short answer per decoding mode before serving, so that one-time costs (first
    kernels, allocator growth) stay out of the first visitor's statistics."""
    picture = Image.new("RGB", (84, 84), (200, 120, 40))
    messages = [{"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": "Hi"}]}]
    from engine.loop import DecodeSettings

    for drafter in [None, *engine.drafters]:
        for _ in engine.stream(messages, drafter=drafter, decode=DecodeSettings(max_new_tokens=4)):
            pass
