"""The settings a request carries, defined once (as vLLM's `EngineArgs`): each field's metadata
gives its help, range, public-server ceiling and its variable, and UI label, and everything else
is made from it:

    add_cli_args(parser)            # the flags of `python -m engine` (--draft-tokens ...), measure.*
    Settings(**values).check(...)   # one RequestError naming the setting: "top_p must be over 0 ..."
    api_names()                     # the parameters of the app's /chat and /ab, in this order
    control("draft_tree")           # a sidebar control: label, (least, most, step) or choices, help
    Ceilings.from_environ()         # a public server's own bounds (VLM_MAX_DRAFT_TOKENS ...), check_ceilings

The field's name is the setting's one name: the API parameter, the flag (`--` and dashes), the
message. The range is what the engine takes (the exactness claim holds over all of it); a public
server's ceiling (`ceiling`, its variable `ceiling_env`) may be lower, a UI range (`ui`) narrower.
docs/settings.md lists them (tests/test_settings.py checks that page against this schema).

Every environment variable of every schema (these settings' ceilings, the load settings of
engine/load_settings.py, the visitors' limits of app_ui/limits.py, the process's switches) is read
by one function, engine/schema.py `environ_values` / `from_environ`, from the field's `env` and its
range; `Spec` and `setting` are defined there too, in a module that imports nothing of the engine.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field, fields, make_dataclass, replace
from typing import Any, get_type_hints

from engine.loop import DecodeSettings
from engine.sampling import SamplingSettings
from engine.schema import Spec, from_environ, setting
from engine.tree import MAX_DRAFT_NODES

MODES = ("speculative", "plain")
# The most tokens an image, or top-k, may ask for: far over any model's own (a Qwen2.5-VL image: 16,384
# tokens; a vocabulary: 262,144), and a number every JSON encoder and server takes (2**64 did not: the
# answer's statistics could not be sent).
MAX_COUNT, MAX_COUNT_TEXT = 2**20, "2**20"
CHARS_PER_TOKEN = 16  # a text may be this many characters per token of context, checked before tokenizing


class RequestError(ValueError):
    """The request cannot be answered as sent (a setting out of range, too many images...); says why."""


@dataclass(frozen=True)
class Settings:
    """Per-request generation settings; the defaults are the API's (greedy, so deterministic).
    The field order is the API's parameter order (new settings go at the end)."""

    mode: str = setting("speculative", "speculative: a drafter proposes tokens and the model verifies them in one "
                        "pass; plain: one token per pass", "Decoding", choices=MODES)
    drafter: str | None = setting(None, "a loaded drafter's key (text, vlm, ngram, mtp, ...), auto, or none: the "
                                  "engine's default", "Drafter", cli=False)
    draft_tokens: int = setting(0, "tokens drafted a round (0: chosen each round from measured cost)", "Draft length",
                                low=0, high=MAX_DRAFT_NODES, low_means="0 (chosen from cost)", ui=(0, 8, 1),
                                ceiling=16, ceiling_env="VLM_MAX_DRAFT_TOKENS")
    adaptive: bool = setting(False, "the +2/-1 rule from draft_tokens (or 4): +2 after a full acceptance, -1 after "
                             "a rejection", "Adaptive draft length")
    temperature: float = setting(0.0, "0: greedy, the same answer every time", "Temperature", low=0,
                                 low_means="0 (greedy)", ui=(0, 1.5, 0.05))
    top_p: float = setting(1.0, "sample from the smallest set of tokens this likely (1: all)", "Top-p", low=0,
                           high=1, above_low=True, ui=(0.05, 1, 0.05))
    max_new_tokens: int = setting(256, "the answer's most tokens", "Max new tokens", low=1, high=4096,
                                  ui=(1, 1024, 1), ceiling=4096, ceiling_env="VLM_MAX_NEW_TOKENS")
    seed: int = setting(0, "the sampler's seed (with temperature over 0): the same settings give the same answer "
                        "again at a fixed draft length; with draft length 0 (chosen from measured cost) the answer can depend on "
                        "the machine's load, which changes k and so the random numbers drawn", "Seed", low=0,
                        high=2**63 - 1, high_text="2**63 - 1")
    system_prompt: str = setting("", "an instruction placed before the conversation", "System prompt (optional)")
    max_image_tokens: int | None = setting(None, "at most about this many tokens per image (0: the model's processor's "
                                           "own limit; none: the engine's default)", "Tokens per image at most", low=0,
                                           high=MAX_COUNT, high_text=MAX_COUNT_TEXT,
                                           low_means="0 (the model's own limit)", env="VLM_MAX_IMAGE_TOKENS",
                                           cli=False)
    draft_tree: int = setting(0, "draft trees of up to this many nodes, as deep as the draft length, verified in one pass "
                              "(0: one chain)", "Draft tree nodes", low=0, high=MAX_DRAFT_NODES, low_means="0 (chains)",
                              ui=(0, 16, 1), ceiling=32, ceiling_env="VLM_MAX_DRAFT_TREE")
    top_k: int = setting(0, "sample from the k likeliest tokens (0: off)", "Top-k", low=0, low_means="0 (off)",
                         high=MAX_COUNT, high_text=MAX_COUNT_TEXT, ui=(0, 100, 1))
    tree_branching: int = setting(2, "a draft tree node's most children", "Tree branching", low=1, high=16,
                                  ui=(1, 4, 1))

    def check(self, drafters: list[str] | None = None, context_limit: int | None = None) -> Settings:
        """The settings converted to their types and checked; RequestError names the first that is
        not of its type, not a choice or out of range. `drafters`: the engine's choices for
        `drafter` (None: not checked here); `context_limit`: the system prompt's bound."""
        values = {}
        for name in names():
            value = convert(name, getattr(self, name))
            if name == "drafter" and drafters is not None:
                check_choice(name, value, [*drafters, "none", "", None])
            elif name == "system_prompt":
                check_text(value, context_limit, "system_prompt")
            else:
                check_value(name, value)
            values[name] = value
        return replace(self, **values)

    def sampling(self) -> SamplingSettings:
        return SamplingSettings(temperature=float(self.temperature), top_p=float(self.top_p), top_k=int(self.top_k),
                                seed=int(self.seed))

    def decode(self, **more) -> DecodeSettings:
        """The loop's settings (`more`: stop_token_ids and the like)."""
        return DecodeSettings(max_new_tokens=int(self.max_new_tokens), draft_tokens=int(self.draft_tokens) or None,
                              adaptive=bool(self.adaptive), draft_tree=int(self.draft_tree or 0),
                              tree_branching=int(self.tree_branching), **more)


def names() -> list[str]:
    """Every setting, in the API's order."""
    return [f.name for f in fields(Settings)]


def spec(name: str) -> Spec:
    return Settings.__dataclass_fields__[name].metadata["spec"]


def default(name: str) -> Any:
    return Settings.__dataclass_fields__[name].default


def kind(name: str) -> type:
    """The setting's type: int, float, bool or str (an optional one's non-None type)."""
    hint = get_type_hints(Settings)[name]
    return next(arg for arg in getattr(hint, "__args__", (hint,)) if arg is not type(None))


def api_names(mode: bool = True) -> list[str]:
    """The parameters of /chat (and of /ab, which has no mode: it runs both)."""
    return [name for name in names() if mode or name != "mode"]


def convert(name: str, value: Any) -> Any:
    """`value` as the setting's type (a whole-valued float counts as an int; an optional setting
    takes None); RequestError naming the setting."""
    wanted = kind(name)
    if value is None and default(name) is None:
        return None
    if wanted is str:
        return "" if value is None and name == "system_prompt" else value
    if wanted is bool and isinstance(value, bool):
        return value
    if wanted in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        if wanted is float:
            try:
                return float(value)
            except OverflowError:  # a whole number over 1e308 (JSON carries any)
                raise RequestError(f"{name} must be a finite number, got {_shown(value)}") from None
        if isinstance(value, int) or (math.isfinite(value) and value == int(value)):
            return int(value)
    words = {int: "a whole number", float: "a number", bool: "true or false"}[wanted]
    raise RequestError(f"{name} must be {words}, got {value!r}")


def check_choice(name: str, value: Any, choices: list) -> None:
    if value not in choices:
        listed = ", ".join(str(choice) for choice in choices if choice)
        raise RequestError(f"{name} {value} is not in the list of choices ({listed})"[:300])


def check_value(name: str, value: Any) -> None:
    """RequestError when `value` (already of the setting's type) is not a choice or out of range:
    "draft_tokens must be from 0 (chosen from cost) to 64, got 65"."""
    meta = spec(name)
    if meta.choices:
        check_choice(name, value, list(meta.choices))
    if value is None or isinstance(value, (str, bool)) or (meta.low is None and meta.high is None):
        return
    low = meta.low_means or _number(meta.low)
    high = meta.high_text or _number(meta.high)
    below = meta.low is not None and (value <= meta.low if meta.above_low else value < meta.low)
    over = meta.high is not None and value > meta.high
    if not (below or over or (isinstance(value, float) and not math.isfinite(value))):
        return
    if meta.high is None:
        raise RequestError(f"{name} must be {low} or more, got {_shown(value)}")
    if meta.above_low:
        raise RequestError(f"{name} must be over {low} and at most {high}, got {_shown(value)}")
    raise RequestError(f"{name} must be from {low} to {high}, got {_shown(value)}")


def _shown(value) -> str:
    """`value` for a message: a whole number of hundreds of digits by its size alone."""
    if isinstance(value, int) and value.bit_length() > 100:
        return f"a {value.bit_length():,}-bit number"
    return str(value)


def _number(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:g}" if isinstance(value, float) and value != int(value) else str(int(value))


def check_text(text: str, context_limit: int | None, what: str = "the message") -> None:
    """RequestError when `text` is not a string, not valid Unicode, or over CHARS_PER_TOKEN
    characters per token of the context (a bound far over what a context holds in practice):
    refused before anything tokenizes it."""
    if not isinstance(text, str):
        raise RequestError(f"{what}: the text must be a string, not {type(text).__name__}")
    if context_limit and len(text) > context_limit * CHARS_PER_TOKEN:
        raise RequestError(f"{what} is {len(text):,} characters; the model's context ({context_limit:,} tokens) "
                           f"takes at most {context_limit * CHARS_PER_TOKEN:,} characters: send a shorter text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RequestError(f"{what} is not valid Unicode (an unpaired surrogate at character {error.start})") from None


def control(name: str) -> dict:
    """What the app's sidebar needs to draw the setting's control: its label, help, default, and
    either its choices (a dropdown or radio) or its (least, most, step) (a slider: `ui` where it is
    narrower than the range, else the range, step 1 for a whole number); a text or a switch has neither."""
    meta = spec(name)
    shown = {"label": meta.label, "info": meta.help, "value": default(name), "choices": meta.choices or None,
             "range": None}
    if meta.ui is not None:
        shown["range"] = meta.ui
    elif meta.low is not None and meta.high is not None and not meta.choices:
        shown["range"] = (meta.low, meta.high, 1 if kind(name) is int else None)
    return shown


def _ceiling(name: str):
    meta = spec(name)
    return field(default=meta.ceiling, metadata={"spec": Spec(
        f"a request's {name} at most", low=1, high=meta.high, env=meta.ceiling_env,
        high_text=f"the most the settings allow ({_number(meta.high)})")})


# A public server's bounds on one request, one field per setting with a `ceiling` (check_ceilings).
Ceilings = make_dataclass("Ceilings", [(name, int, _ceiling(name)) for name in names() if spec(name).ceiling],
                          frozen=True, namespace={
                              "__doc__": "A public server's bounds on one request, each from its variable "
                                         "(Spec.ceiling_env); over the settings' range is refused.",
                              "from_environ": classmethod(lambda cls, environ=os.environ: from_environ(
                                  cls, environ, RequestError))})
Ceilings.__module__ = __name__


def check_ceilings(max_new_tokens: int, draft_tokens: int, draft_tree: int, ceilings: Ceilings | None = None) -> None:
    """RequestError naming the first of a request's settings over the server's ceiling
    (default: Ceilings from the environment); draft_tokens 0 and draft_tree 0 are the defaults."""
    ceilings = ceilings or Ceilings.from_environ()
    given = {"max_new_tokens": max_new_tokens, "draft_tokens": draft_tokens, "draft_tree": draft_tree}
    for option in fields(Ceilings):
        low, value, ceiling = spec(option.name).low, given[option.name], getattr(ceilings, option.name)
        if not low <= value <= ceiling:
            raise RequestError(f"{option.name} must be from {low:g} to {ceiling} on this server "
                               f"({ceiling_variable(option.name)}), got {value}")


def ceiling_variable(name: str) -> str:
    """The variable of the setting's server ceiling: VLM_MAX_NEW_TOKENS, VLM_MAX_DRAFT_TOKENS, VLM_MAX_DRAFT_TREE."""
    return spec(name).ceiling_env


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_cli_args(parser: argparse.ArgumentParser, only: list[str] | None = None, **defaults) -> None:
    """A flag per setting (those of `only`, default: every one the CLI takes), its help and default
    from the schema (`defaults` overrides one: a benchmark's shorter answers); values out of range
    are refused by `check`, naming the setting."""
    for name in only or [name for name in names() if spec(name).cli]:
        meta, value = spec(name), defaults.get(name, default(name))
        help = meta.help + (f" (default {value})" if value not in (None, "", False) else "")
        if kind(name) is bool:
            parser.add_argument(flag(name), action="store_true", default=value, help=meta.help)
        else:
            metavar = None if meta.choices else {int: "N", float: "X", str: "TEXT"}[kind(name)]
            parser.add_argument(flag(name), type=kind(name), default=value, choices=meta.choices or None,
                                metavar=metavar, help=help.replace("%", "%%"))


def from_args(args: argparse.Namespace, **values) -> Settings:
    """The settings the parsed flags give (the others at their defaults, or as `values`), checked."""
    given = {name: getattr(args, name) for name in names() if spec(name).cli and hasattr(args, name)}
    return Settings(**{**given, **values}).check()


def table() -> str:
    """The settings as a Markdown table (docs/settings.md holds it; a test keeps the two equal)."""
    rows = ["| setting (API) | flag | default | range | a public server's ceiling | what it does |",
            "|---|---|---|---|---|---|"]
    for name in names():
        meta, value = spec(name), default(name)
        if meta.choices:
            bounds = ", ".join(meta.choices)
        elif meta.low is None and meta.high is None:
            bounds = ""
        else:
            low = ("over " if meta.above_low else "") + _number(meta.low)
            high = meta.high_text or _number(meta.high)
            bounds = (f"{low}, at most {high}" if meta.above_low else f"{low} to {high}") if meta.high is not None \
                else f"{low} or more"
        where = flag(name) if meta.cli else f"({flag(name)}: a load flag)"
        ceiling = f"{meta.ceiling} (`{meta.ceiling_env}`)" if meta.ceiling else ""
        rows.append(f"| `{name}` | `{where}` | `{value!r}` | {bounds} | {ceiling} | {meta.help} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(table(), end="")
