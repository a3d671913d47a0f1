"""Configuration from flags and environment variables, and the engine built from it.

Every flag has an environment variable (for Hugging Face Spaces, where there are no flags); a
flag wins over its variable. The model and load flags (--preset, --model, --drafter, --dtype,
--device, ...) and their VLM_* variables are made from one schema (engine/load_settings.py);
the app's own are `AppSettings` below (--host, --port, --share, --no-browser, --max-images,
--desktop, --backend, --ab-backend, --image-backend), schema fields of the same kind; every variable of both is read by
engine/schema.py `from_environ`. `python app.py --help` lists every flag and every variable.

A bad value, of a flag or a variable, raises SetupError naming it (app.py prints one line).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields, replace

from PIL import Image

from app_ui.uploads import return_freed_memory
from app_ui.visitors import Limits
from engine.image_jail import Decoding
from engine.build import EngineSpec, spec_from_args
from engine.engine import Ceilings, ceiling_variable
from engine.load_settings import add_model_flags, check_variables, variables
from engine.schema import from_environ, read_variable, setting, specs_of, switch_variables
from engine.settings import flag
from models.loading import LoadError


class SetupError(Exception):
    """The app cannot start; the message (one line) says why and what to do."""


@dataclass
class Config:
    spec: EngineSpec  # the models and how to load them (engine/build.py), as for every command
    host: str = "127.0.0.1"
    port: int | None = None
    share: bool = False
    open_browser: bool = True
    desktop: bool = False  # a window of its own (app_ui/desktop.py) instead of a browser tab
    behind_proxy: bool = False  # on a Space: a client's address is the rightmost entry of X-Forwarded-For
    backend: str | None = None  # a server's URL, or llamacpp[:PATH], answering instead of the loaded model
    ab_backend: str | None = None  # the same, for the A/B tab to compare with the app's backend
    image_backend: str | None = None  # a server's URL: turns with images when --backend's draft model refuses them

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


MAX_IMAGES = 64


@dataclass(frozen=True)
class AppSettings:
    """The app's own settings, after the load settings (engine/load_settings.py): each a flag (`--`
    and dashes) and its variable, read by engine/schema.py `from_environ` (the one reader)."""

    host: str = setting("127.0.0.1", "the address to serve on (default: 127.0.0.1; 0.0.0.0 on a Space)",
                        env="VLM_HOST")
    port: int | None = setting(None, "the port to serve on (default: 7860, or the next free one)", low=1, high=65535,
                               env="VLM_PORT")
    share: bool = setting(False, "also serve a public gradio.live link", env="VLM_SHARE")
    no_browser: bool = setting(False, "do not open a browser (never opened on a Space)", env="VLM_NO_BROWSER")
    desktop: bool = setting(False, "open the app in a window of its own instead of a browser tab (pywebview on Qt "
                            "WebEngine: pip install -r requirements-desktop.txt); closing it stops the app",
                            env="VLM_DESKTOP")
    max_images: int = setting(8, f"images per conversation, 1 to {MAX_IMAGES} (default: 8)", low=1, high=MAX_IMAGES,
                              env="VLM_MAX_IMAGES")
    backend: str | None = setting(None, "answer with this OpenAI-compatible server (URL#MODEL names its model; API "
                                  "key: VLM_BACKEND_API_KEY) instead of loading a model, or with llama.cpp in this "
                                  "process: PATH (a checkpoint folder, converted to GGUF on first use; a .gguf file; "
                                  "a folder of GGUF files), else the model the flags name (the 3.6 M demo with its "
                                  "text drafter as draft model)",
                                  env="VLM_BACKEND")
    ab_backend: str | None = setting(None, "the A/B tab compares the app's backend with this one (as --backend)",
                                     env="VLM_AB_BACKEND")
    image_backend: str | None = setting(None, "turns with images go to this OpenAI-compatible server (URL#MODEL), "
                                        "plainly, when --backend is a llama-server whose draft model refuses them "
                                        "(the same model served without --model-draft: docs/backends.md)",
                                        env="VLM_IMAGE_BACKEND")


# Gradio's own variables, read after VLM_HOST and VLM_PORT; and the flags' metavars where the name is not enough.
GRADIO_VARIABLES = {"host": "GRADIO_SERVER_NAME", "port": "GRADIO_SERVER_PORT"}
METAVARS = {"backend": "URL|llamacpp[:PATH]", "ab_backend": "URL|llamacpp[:PATH]", "image_backend": "URL"}


def read_config(argv: list[str] | None = None, environ=os.environ) -> Config:
    """The app's settings: flags, else VLM_* variables, else defaults. A bad flag or variable
    raises SetupError naming it (one line); --help prints the usage and exits."""
    args = app_parser(environ).parse_args(argv)
    try:
        check_variables(args)
        spec = spec_from_args(args, max_images=args.max_images)
    except LoadError as error:
        raise SetupError(str(error)) from None
    if spec.drafters and "ngram" not in spec.drafters:
        spec = replace(spec, drafters=spec.drafters + ("ngram",))  # the app always offers n-gram: it costs nothing
    return Config(spec, args.host, args.port, args.share, not (args.no_browser or args.desktop), desktop=args.desktop,
                  behind_proxy=bool(environ.get("SPACE_ID")), backend=args.backend, ab_backend=args.ab_backend,
                  image_backend=args.image_backend)


def app_settings(environ=os.environ) -> AppSettings:
    """AppSettings from the VLM_* variables, else Gradio's (GRADIO_SERVER_NAME, GRADIO_SERVER_PORT),
    else a Space's defaults (0.0.0.0, no browser), else the schema's; SetupError names a bad variable."""
    on_space = bool(environ.get("SPACE_ID"))
    fallback = {"host": "0.0.0.0"} if on_space else {}
    for name, wanted, meta in specs_of(AppSettings):
        variable = GRADIO_VARIABLES.get(name)
        if variable and environ.get(variable):
            fallback[name] = read_variable(variable, environ[variable], wanted, meta, SetupError)
    settings = from_environ(AppSettings, environ, SetupError, **fallback)
    return replace(settings, no_browser=True, desktop=False) if on_space else settings


def app_parser(environ=os.environ) -> argparse.ArgumentParser:
    """The app's flags (the load settings', then AppSettings'), their defaults from `environ`; a bad
    variable raises SetupError naming it, a bad flag's number too ("--port: 99999 is over 65535")."""
    parser = _Parser(prog="python app.py", description="Chat with a VLM; speculative decoding.",
                     epilog=environment_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    try:
        add_model_flags(parser, environ)
    except LoadError as error:
        raise SetupError(str(error)) from None
    given = app_settings(environ)
    for name, wanted, meta in specs_of(AppSettings):
        if wanted is bool:
            parser.add_argument(flag(name), action="store_true", default=getattr(given, name), help=meta.help)
        else:
            parser.add_argument(flag(name), type=_reader(flag(name), wanted, meta), default=getattr(given, name),
                                metavar=METAVARS.get(name), help=meta.help)
    return parser


def _reader(name: str, wanted: type, meta):
    """A flag's type: its text read as its variable's is (engine/schema.py `read_variable`), named by the flag."""
    return lambda text: read_variable(name, text, wanted, meta, SetupError)


# The variables outside the schemas (engine/load_settings.py, AppSettings, engine/schema.py Switches):
# (variable, what it gives). The smol demo's cache is read in models/, which imports nothing of the engine.
OTHER_VARIABLES = [("VLM_BACKEND_API_KEY", "the servers' API key (sent to them only)"),
                   ("VLM_SPECULATIVE_CHAT_CACHE", "where --preset smol assembles its model (default "
                                                  "$XDG_CACHE_HOME/vlm-speculative-chat or ~/.cache/...)"),
                   ("GRADIO_SERVER_NAME, GRADIO_SERVER_PORT", "host and port, after VLM_HOST and VLM_PORT"),
                   ("SPACE_ID (set on a Hugging Face Space)", "serve on 0.0.0.0, open no browser")]


def environment_help() -> str:
    """The environment list of `python app.py --help`: every variable and the flag it gives, then
    the process's switches (engine/schema.py Switches), then the public server's bounds (a request's
    ceilings, engine/settings.py; the visitors' limits, app_ui/limits.py; docs/security.md) with
    their defaults."""
    ceilings = [(ceiling_variable(f.name), f"a request's {f.name} at most (default {f.default})")
                for f in fields(Ceilings)]
    limits = [(f"VLM_{f.name.upper()}", f"the visitors' limit {f.name} (default {f.default:,})") for f in fields(Limits)]
    defaults = Decoding()  # engine/image_jail.py
    decoding = [(meta.env, meta.help + ("" if getattr(defaults, name) is None else f" (default {getattr(defaults, name):g})"))
                for name, _, meta in specs_of(Decoding)]
    rows = [*variables(), *variables(AppSettings), *switch_variables(), *OTHER_VARIABLES, *ceilings, *limits, *decoding]
    return "environment variables (a flag wins over its variable; VLM_DRAFTER may list several drafters,\n" \
           "separated by commas):\n" + "\n".join(f"  {variable:<40} {what}" for variable, what in rows)


class _Parser(argparse.ArgumentParser):
    """Errors raise SetupError (one line, exit status 1 in app.py) instead of printing the usage."""

    def error(self, message: str):
        raise SetupError(message)


def assemble_target(config: Config) -> Config:
    """`config` with the smol demo's assembled folder for its target (fetched and built the first time)."""
    from engine.build import with_assembled_target

    try:
        return replace(config, spec=with_assembled_target(config.spec))
    except LoadError as error:
        raise SetupError(str(error)) from None


def load_engine(config: Config):
    """The engine with every drafter of the config (engine/build.py: keyed "text", "vlm", "ngram"...)."""
    from engine.build import build_engine

    try:
        return build_engine(config.spec)
    except LoadError as error:
        raise SetupError(str(error)) from None


def open_backends(config: Config):
    """The backends of --backend and --ab-backend (None where not set): "llamacpp[:PATH]" starts
    llama.cpp in a child process (engine/backends/llamacpp.py `LlamaCpp.open`: PATH, else the app's
    own model, converted to GGUF on first use), anything else is an
    OpenAI-compatible server's URL (its turns with images go to --image-backend's server, if set,
    when its draft model refuses them). A bad URL or PATH, a missing xllamacpp, a failed conversion or a
    server that does not start is SetupError (one line)."""
    from engine.backends.openai import OpenAIServer

    def open_one(flag: str, value: str | None, images: OpenAIServer | None = None):
        if not value:
            return None
        kind, _, path = value.partition(":")
        if kind != "llamacpp":
            return OpenAIServer(value, images=images)
        try:
            from engine.backends.llamacpp import LlamaCpp

            return LlamaCpp.open(path or own_model_for_llamacpp(config, flag))
        except ImportError as error:
            raise SetupError(f"{flag} {value}: {error.name or error} is not installed "
                             "(pip install -r requirements.txt)") from None
        except Exception as error:  # a bad PATH (ValueError), a failed conversion, the server's own failure
            first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise SetupError(f"{flag} {value}: {first_line}") from None

    try:
        if config.image_backend and not (config.backend and config.backend.partition(":")[0] != "llamacpp"):
            raise SetupError("--image-backend answers the image turns of --backend URL; give --backend a server's URL")
        images = OpenAIServer(config.image_backend) if config.image_backend else None
        return open_one("--backend", config.backend, images), open_one("--ab-backend", config.ab_backend)
    except ValueError as error:
        raise SetupError(str(error)) from None


def own_model_for_llamacpp(config: Config, flag: str) -> str | None:
    """What `llamacpp` without PATH runs: the model the flags name (the same weights as the built-in
    engine's, for A/B), as a folder (the smol demo assembled first); None for the 3.6 M demo, which
    LlamaCpp.open serves with its text drafter as draft model."""
    from models.presets import DEMO_MODEL

    target = assemble_target(config).model
    if os.path.abspath(target) == os.path.abspath(DEMO_MODEL):
        return None
    if not os.path.isfile(os.path.join(target, "config.json")):
        raise SetupError(f"{flag} llamacpp: the model {target} is not a local folder; give llamacpp:PATH (a "
                         "checkpoint folder or GGUF files)")
    return target


def warm_up(engine) -> None:
    """One short answer per decoding mode before serving, so that one-time costs (first
    kernels, allocator growth) stay out of the first visitor's statistics; then the heap pages
    the load and the warm-up freed go back to the system (glibc's `malloc_trim(0)`, a no-op
    elsewhere: the loader's copies, about 340 MB for the smol demo, docs/app.md "Memory")."""
    picture = Image.new("RGB", (84, 84), (200, 120, 40))
    messages = [{"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": "Hi"}]}]
    from engine.loop import DecodeSettings

    for drafter in [None, *engine.drafters]:
        for _ in engine.stream(messages, drafter=drafter, decode=DecodeSettings(max_new_tokens=4)):
            pass
    engine.costs.reset()  # cold-start timings and a made-up prompt say nothing about the requests to come
    return_freed_memory()
