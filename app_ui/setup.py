"""Configuration from flags and environment variables, and the engine built from it.

Every flag has an environment variable (for Hugging Face Spaces, where there are no flags);
a flag wins over its variable:

    --preset   VLM_PRESET    named target + drafters (default: demo, the bundled model)
    --model    VLM_MODEL     target VLM: hub id or folder (overrides the preset's)
    --drafter  VLM_DRAFTER   drafter: hub id, folder, "ngram" or "none"; repeat the flag, or
                             separate with commas (default: the preset's, or ngram with --model)
    --dtype    VLM_DTYPE     fit (default: float32, exact A/B, when it takes at most 40% of the
                             memory, else bfloat16), float32, bfloat16, float16, auto
    --device   VLM_DEVICE    auto (default), cpu, cuda
    --quantization  VLM_QUANTIZATION  4bit or 8bit (bitsandbytes), int8 (the fast decode path's;
                             default none)
    --drafter-dtype  VLM_DRAFTER_DTYPE  auto (default: float32 on a CPU for drafters under 10M
                             parameters, else --dtype), float32, bfloat16, float16
    --host     VLM_HOST      default 127.0.0.1 (0.0.0.0 on a Space)
    --port     VLM_PORT      default 7860, or the next free port
    --share    VLM_SHARE=1   a public gradio.live link
    --no-browser  VLM_NO_BROWSER=1   do not open the browser (never opened on a Space)
    --max-images  VLM_MAX_IMAGES     images per conversation (default 8, at most 64)
    --trust-remote-code  VLM_TRUST_REMOTE_CODE=1   run a checkpoint's own Python code (off: such a
                             model is refused with a message naming this flag)
    --backend  VLM_BACKEND   an OpenAI-compatible server's URL (vLLM, SGLang, llama-server) that
                             answers instead of a loaded model; its API key from VLM_BACKEND_API_KEY
    --ab-backend  VLM_AB_BACKEND   the A/B tab compares the app's backend with this server's URL
                             (default: plain vs speculative decoding of the app's own backend)

A bad value, of a flag or a variable, raises SetupError naming it (app.py prints one line).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace

from PIL import Image

from engine.build import TRUE, EngineSpec, add_model_flags, spec_from_args
from models.loading import DEVICES, DRAFTER_DTYPES, DTYPES, QUANTIZATIONS, LoadError
from models.presets import PRESETS


class SetupError(Exception):
    """The app cannot start; the message (one line) says why and what to do."""


@dataclass
class Config:
    spec: EngineSpec  # the models and how to load them (engine/build.py), as for every command
    host: str = "127.0.0.1"
    port: int | None = None
    share: bool = False
    open_browser: bool = True
    behind_proxy: bool = False  # on a Space: a client's address is the first of X-Forwarded-For
    backend: str | None = None  # a server's URL that answers instead of the loaded model (docs/backends.md)
    ab_backend: str | None = None  # a server's URL that the A/B tab compares with the app's backend

    @property
    def model(self) -> str:
        return self.spec.target

    @property
    def drafters(self) -> list[str]:
        return list(self.spec.drafters)

    @property
    def trust_remote_code(self) -> bool:
        return self.spec.options.trust_remote_code

    @property
    def max_images(self) -> int:
        return self.spec.max_images


def read_config(argv: list[str] | None = None, environ=os.environ) -> Config:
    """The app's settings: flags, else VLM_* variables, else defaults. A bad flag or variable
    raises SetupError naming it (one line); --help prints the usage and exits."""
    on_space = bool(environ.get("SPACE_ID"))

    def env(name: str, default=None):
        return environ.get(f"VLM_{name}") or default

    parser = _Parser(prog="python app.py", description="Chat with a VLM; speculative decoding.",
                     epilog=ENVIRONMENT, formatter_class=argparse.RawDescriptionHelpFormatter)
    try:
        add_model_flags(parser, env=env)
    except LoadError as error:
        raise SetupError(str(error)) from None
    parser.add_argument("--host", default=env("HOST", environ.get("GRADIO_SERVER_NAME")
                                             or ("0.0.0.0" if on_space else "127.0.0.1")),
                        help="the address to serve on (default: 127.0.0.1; 0.0.0.0 on a Space)")
    parser.add_argument("--port", type=_whole("--port", 1, 65535),
                        help="the port to serve on (default: 7860, or the next free one)")
    parser.add_argument("--share", action="store_true", default=env("SHARE", "").lower() in TRUE,
                        help="also serve a public gradio.live link")
    parser.add_argument("--no-browser", action="store_true", default=on_space or env("NO_BROWSER", "").lower() in TRUE,
                        help="do not open a browser (never opened on a Space)")
    parser.add_argument("--max-images", type=_whole("--max-images", 1, MAX_IMAGES),
                        help=f"images per conversation, 1 to {MAX_IMAGES} (default: 8)")
    parser.add_argument("--backend", default=env("BACKEND"), metavar="URL",
                        help="answer with this OpenAI-compatible server instead of loading a model "
                             "(API key: VLM_BACKEND_API_KEY)")
    parser.add_argument("--ab-backend", default=env("AB_BACKEND"), metavar="URL",
                        help="the A/B tab compares the app's backend with this server")
    args = parser.parse_args(argv)
    _check_variables(args)

    port_variable = env("PORT") or environ.get("GRADIO_SERVER_PORT")
    port = args.port if args.port is not None else (
        _whole("VLM_PORT", 1, 65535)(port_variable) if port_variable else None)
    max_images = args.max_images if args.max_images is not None else (
        _whole("VLM_MAX_IMAGES", 1, MAX_IMAGES)(env("MAX_IMAGES")) if env("MAX_IMAGES") else 8)
    try:
        spec = spec_from_args(args, max_images=max_images)
    except LoadError as error:
        raise SetupError(str(error)) from None
    if spec.drafters and "ngram" not in spec.drafters:
        spec = replace(spec, drafters=spec.drafters + ("ngram",))  # the app always offers n-gram: it costs nothing
    return Config(spec, args.host, port, args.share, not args.no_browser, behind_proxy=on_space,
                  backend=args.backend, ab_backend=args.ab_backend)


MAX_IMAGES = 64
ENVIRONMENT = """environment variables (a flag wins over its variable):
  VLM_PRESET, VLM_MODEL, VLM_DTYPE, VLM_DRAFTER_DTYPE, VLM_DEVICE, VLM_QUANTIZATION,
  VLM_MAX_IMAGE_TOKENS, VLM_HOST, VLM_PORT, VLM_MAX_IMAGES   the flag of the same name
  VLM_DRAFTER                                                 --drafter; several separated by commas
  VLM_BACKEND, VLM_AB_BACKEND                                 --backend URL, --ab-backend URL
  VLM_BACKEND_API_KEY                                         the servers' API key (sent to them only)
  VLM_TRUST_REMOTE_CODE=1, VLM_SHARE=1, VLM_NO_BROWSER=1      the switches
  GRADIO_SERVER_NAME, GRADIO_SERVER_PORT                      host and port, after VLM_HOST and VLM_PORT
  SPACE_ID (set on a Hugging Face Space)                      serve on 0.0.0.0, open no browser"""
# Flags whose value a variable may give (argparse checks a flag's value, not a default's).
VARIABLE_CHOICES = {"preset": ("PRESET", sorted(PRESETS)), "dtype": ("DTYPE", DTYPES),
                    "device": ("DEVICE", DEVICES), "drafter_dtype": ("DRAFTER_DTYPE", DRAFTER_DTYPES),
                    "quantization": ("QUANTIZATION", QUANTIZATIONS)}


def _check_variables(args: argparse.Namespace) -> None:
    """A value that came from a VLM_ variable must be one of its flag's choices."""
    for dest, (name, choices) in VARIABLE_CHOICES.items():
        value = getattr(args, dest)
        if value is not None and value not in choices:
            raise SetupError(f"VLM_{name}: {value!r} is not one of {', '.join(choices)}")


class _Parser(argparse.ArgumentParser):
    """Errors raise SetupError (one line, exit status 1 in app.py) instead of printing the usage."""

    def error(self, message: str):
        raise SetupError(message)


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
    """The engine with every drafter of the config (engine/build.py: keyed "text", "vlm", "ngram"...)."""
    from engine.build import build_engine

    try:
        return build_engine(config.spec)
    except LoadError as error:
        raise SetupError(str(error)) from None


def open_backends(config: Config):
    """The servers of --backend and --ab-backend (None where not set); a bad URL is SetupError."""
    from engine.backends.openai import OpenAIServer

    try:
        return tuple(OpenAIServer(url) if url else None for url in (config.backend, config.ab_backend))
    except ValueError as error:
        raise SetupError(str(error)) from None


def warm_up(engine) -> None:
    """One short answer per decoding mode before serving, so that one-time costs (first
    kernels, allocator growth) stay out of the first visitor's statistics."""
    picture = Image.new("RGB", (84, 84), (200, 120, 40))
    messages = [{"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": "Hi"}]}]
    from engine.loop import DecodeSettings

    for drafter in [None, *engine.drafters]:
        for _ in engine.stream(messages, drafter=drafter, decode=DecodeSettings(max_new_tokens=4)):
            pass
    engine.costs.reset()  # cold-start timings and a made-up prompt say nothing about the requests to come
