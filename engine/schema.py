"""The schemas' pieces: a field's metadata (`Spec`, `setting`), the one reader of every
environment variable (`environ_values`, `from_environ`), and the process's switches (`Switches`).

engine/settings.py's request settings, engine/load_settings.py's load settings, app_ui/setup.py's
AppSettings and app_ui/limits.py's Limits are dataclasses of `setting(...)` fields; a field's
`env` names its variable, read here from the field's type and range, with one kind of message
("VLM_SESSIONS: -1 is under 0"). This module imports nothing of the engine, so that every module
may read its variables through it (engine/fast_native.py, imported by the decode loop that
engine/settings.py imports, could not import engine/settings.py without an import circle).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, get_args, get_origin, get_type_hints

TRUE = ("1", "true", "yes", "on")  # a switch's variable is on with one of these


@dataclass(frozen=True)
class Spec:
    """One setting's metadata."""

    help: str
    label: str = ""  # the app's control (a request setting; a load setting has none)
    low: float | None = None  # the least value (None: no bound)
    high: float | None = None  # the most value the engine takes
    above_low: bool = False  # the least value itself is refused ("over 0")
    low_means: str = ""  # what the least value means, quoted in messages: "0 (greedy)"
    high_text: str = ""  # the most value as messages write it ("2**63 - 1")
    choices: tuple[str, ...] = ()  # the allowed values (the drafter's are the engine's)
    ui: tuple[float, float, float] | None = None  # the sidebar's (least, most, step) when narrower than the range
    env: str | None = None  # the environment variable that gives the default (`environ_values`)
    cli: bool = True  # a flag of `python -m engine` made from this field (else the CLI has its own: --drafter)
    ceiling: int | None = None  # a public server's default most value (`Ceilings`), under `high`
    ceiling_env: str | None = None  # ...and the variable that sets it (at most `high`)


def setting(default: Any, help: str, label: str = "", **spec) -> Any:
    return field(default=default, metadata={"spec": Spec(help, label, **spec)})


def specs_of(cls) -> list[tuple[str, type, Spec]]:
    """(name, type, metadata) of every field of the dataclass `cls` that carries a Spec, in order
    (an optional's type is its non-None one; a list's is list)."""
    hints = get_type_hints(cls)
    rows = []
    for f in fields(cls):
        if "spec" in f.metadata:
            hint = next(a for a in get_args(hints[f.name]) or (hints[f.name],) if a is not type(None))
            rows.append((f.name, get_origin(hint) or hint, f.metadata["spec"]))
    return rows


def read_variable(variable: str, text: str, wanted: type, meta: Spec, error: type[Exception] = ValueError):
    """The variable's text as the setting's type (`error` naming the variable when it is not of its
    kind or out of the Spec's range): a switch is on with one of TRUE; a list is one item (commas
    separate several, as in a flag's value); a number is whole for an int, finite for a float."""
    if wanted is bool:
        return text.lower() in TRUE
    if wanted is list:
        return [text]
    if wanted not in (int, float):
        return text
    try:
        number = wanted(text)
    except ValueError:
        raise error(f"{variable}: {text!r} is not a {'whole ' if wanted is int else ''}number") from None
    if not math.isfinite(number):
        raise error(f"{variable}: {text!r} is not a finite number")
    if meta.low is not None and number < meta.low:
        raise error(f"{variable}: {text} is under {meta.low:g}")
    if meta.high is not None and number > meta.high:
        raise error(f"{variable}: {text} is over {meta.high_text or f'{meta.high:g}'}"[:200])
    return number


def environ_values(cls, environ: Mapping[str, str] | None = os.environ,
                   error: type[Exception] = ValueError) -> dict[str, Any]:
    """{field: value} of each field of the dataclass `cls` whose Spec names a variable that is set
    (not empty) in `environ`, read by `read_variable`."""
    values = {}
    for name, wanted, meta in specs_of(cls):
        text = (environ or {}).get(meta.env) if meta.env else None
        if text:
            values[name] = read_variable(meta.env, text, wanted, meta, error)
    return values


def from_environ(cls, environ: Mapping[str, str] | None = os.environ, error: type[Exception] = ValueError,
                 **defaults):
    """An instance of the dataclass `cls`: each field from its variable when set, else from
    `defaults`, else its own default; `error` names a bad variable (one line)."""
    return cls(**{**defaults, **environ_values(cls, environ, error)})


@dataclass(frozen=True)
class Switches:
    """How this process computes, not what it answers: each switch from its variable (`switches()`,
    read where it is used, so a test may set the variable). A switch is on with one of TRUE (any
    other text turns it off); each help says what the switch's other value does, as `python app.py
    --help` lists it (`switch_variables`)."""

    native_layer: bool = setting(True, "decode with the Python layers, not the ones compiled from C++ "
                                 "(engine/fast_native.py)", env="VLM_NATIVE_LAYER")
    native_avx2: bool = setting(False, "compile those layers for AVX2 only (-mno-avx512f), as on a CPU without "
                                "AVX-512 (engine/fast_native.py; measure/as_avx2.py sets it)", env="VLM_NATIVE_AVX2")
    huge_pages: bool = setting(True, "the compiled layers' weights on the default 4 KB pages, not in one buffer on "
                               "2 MB pages (engine/huge_pages.py)", env="VLM_HUGE_PAGES")
    packed_weights: bool = setting(True, "float32 weights that came from a GGUF file's 4-bit or 8-bit blocks read "
                                   "as float32, not from those blocks (engine/packed.py; same answers)",
                                   env="VLM_PACKED_WEIGHTS")
    llamacpp_native: bool = setting(True, "llama.cpp backends run the xllamacpp wheel's server even where llama.cpp "
                                    "was built for this CPU (engine/backends/llamacpp_native.py)",
                                    env="VLM_LLAMACPP_NATIVE")


def switches(environ: Mapping[str, str] | None = os.environ) -> Switches:
    """The switches as `environ` sets them (default: this process's environment, read now)."""
    return from_environ(Switches, environ)


def switch_variables() -> list[tuple[str, str]]:
    """(the variable as set to change its switch, what that does): ("VLM_HUGE_PAGES=0", "the compiled ...")."""
    return [(f"{meta.env}={0 if Switches.__dataclass_fields__[name].default else 1}", meta.help)
            for name, _, meta in specs_of(Switches)]


def switch_table() -> str:
    """The switches as a Markdown table (docs/settings.md holds it; a test keeps the two equal)."""
    rows = ["| variable, as set to change its switch | the switch's default | what that value does |", "|---|---|---|"]
    for f, (variable, what) in zip(fields(Switches), switch_variables()):
        rows.append(f"| `{variable}` | {'on' if f.default else 'off'} | {what} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(switch_table(), end="")
