"""The model and load flags of every command (the app, `python -m engine`, measure.*), defined once
as `Settings` (engine/settings.py) defines a request's: each field's metadata gives the flag
(`--` and dashes), its help, choices or least value, and the environment variable the app reads
it from (Hugging Face Spaces have no flags):

    add_model_flags(parser, environ)   # --preset --model --drafter --dtype ... (defaults from VLM_*)
    check_variables(args)              # "VLM_DEVICE: 'gpu' is not one of auto, cpu, cuda"
    variables()                        # [(variable, --flag)] for `python app.py --help`

A flag wins over its variable. A bad variable raises LoadError naming it (one line); a bad flag is
argparse's error, naming the flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass

from engine.packed import ARITHMETICS
from engine.schema import Spec, environ_values, setting, specs_of
from engine.settings import MAX_COUNT, MAX_COUNT_TEXT, flag
from models.loading import DEVICES, DRAFTER_DTYPES, DTYPES, QUANTIZATIONS, LoadError, LoadOptions
from models.presets import DEFAULT_PRESET, PRESETS

# The default budget of tokens per image on a CPU; on a GPU the processor's own limit. A phone photo at a
# processor's own limit is minutes of prefill on a CPU (docs/realscale.md has the measured figures).
CPU_IMAGE_TOKENS = 384


@dataclass(frozen=True)
class LoadSettings:
    """What to load and how; the field order is the flags' order in --help."""

    preset: str | None = setting(None, f"a named target and drafters: {', '.join(PRESETS)} (default: "
                                 f"{DEFAULT_PRESET}, SmolLM2-135M-Instruct with a vision tower, assembled on first use; "
                                 "demo: the 3.6 M toy, fast)", choices=tuple(sorted(PRESETS)), env="VLM_PRESET")
    model: str | None = setting(None, "hub id or local folder of the target VLM (default: the preset's)",
                                env="VLM_MODEL")
    drafter: list[str] | None = setting(None, "a drafter: hub id or folder (text LM, VLM of the target's family, "
                                        "DFlash or Gemma 4 assistant), 'ngram', 'mtp' (the target's own MTP layers), "
                                        "'auto' (load the others, or the preset's, and pick one per request by "
                                        "measured speed) or 'none'; repeat, or separate with commas (default: the "
                                        "preset's; ngram with --model)", env="VLM_DRAFTER")
    dtype: str = setting("fit", 'the target\'s dtype; "fit" (default): float32 (plain and speculative greedy answers '
                         'identical) when its float32 weights take at most 40% of the memory, else bfloat16',
                         choices=DTYPES, env="VLM_DTYPE")
    drafter_dtype: str = setting(LoadOptions.drafter_dtype, '"auto" (default): float32 on a CPU for drafters under '
                                 '10M parameters, else --dtype (a drafter module that reads the target, such as '
                                 'EAGLE-3: bfloat16 where the CPU has AVX512-BF16 or AMX)', choices=DRAFTER_DTYPES, env="VLM_DRAFTER_DTYPE")
    device: str = setting(LoadOptions.device, 'where the models run; "auto" (default): cuda when there is one, '
                          'else cpu', choices=DEVICES, env="VLM_DEVICE")
    quantization: str | None = setting(None, "4bit / 8bit: load the target in 4 or 8 bits (bitsandbytes); int8: "
                                       "the fast decode path reads int8 copies of the target's text weights; "
                                       "w8a8: and makes the activations int8 too, row by row (AVX512-VNNI; "
                                       "docs/performance.md); q4_0: llama.cpp's Q4_0 4-bit weights times "
                                       "int8 activations", choices=QUANTIZATIONS,
                                       env="VLM_QUANTIZATION")
    weight_arithmetic: str | None = setting(None, "weights read from a GGUF file's blocks (the SmolLM2 demo's): "
                                            "float: float32 rows, the float32 weights' bits; integer: int8 rows per "
                                            "block of 32 times the blocks' codes, as llama.cpp computes (faster; "
                                            "other answers, still the same for plain and speculative decoding); "
                                            "default: the preset's (float for every preset; none with --quantization), float with "
                                            "--model",
                                            choices=ARITHMETICS, env="VLM_WEIGHT_ARITHMETIC")
    max_image_tokens: int | None = setting(None, "the default of the setting max_image_tokens: at most about this "
                                           "many tokens per image (0: the model's processor's own limit; default: "
                                           f"{CPU_IMAGE_TOKENS} on a CPU, the processor's own on a GPU)", low=0,
                                           high=MAX_COUNT, high_text=MAX_COUNT_TEXT, env="VLM_MAX_IMAGE_TOKENS")
    running_requests: int = setting(4, "the most answers the engine decodes together, their target passes shared "
                                    "(engine/worker.py); more wait in line", low=1, high=64,
                                    env="VLM_RUNNING_REQUESTS")
    trust_remote_code: bool = setting(False, "run a checkpoint's own Python code (off: such a model is refused, "
                                      "naming this flag)", env="VLM_TRUST_REMOTE_CODE")


def specs() -> list[tuple[str, type, Spec]]:
    """(name, type, metadata) of every load setting, in order (an optional's type is its non-None one)."""
    return specs_of(LoadSettings)


def add_model_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """A flag per load setting; its default from its variable in `environ` when set (the app passes
    os.environ; the other commands none), else the schema's. A variable that is not a whole number
    where one is wanted, or out of its range, raises LoadError naming it (engine/settings.py
    `environ_values`, the one reader of every variable)."""
    given = environ_values(LoadSettings, environ, LoadError)
    for name, wanted, meta in specs():
        value = given.get(name, LoadSettings.__dataclass_fields__[name].default)
        help = meta.help.replace("%", "%%")
        if wanted is bool:
            parser.add_argument(flag(name), action="store_true", default=value, help=help)
        elif wanted is list:
            parser.add_argument(flag(name), action=_Repeat, default=value, help=help)
        else:
            parser.add_argument(flag(name), type=wanted, default=value, choices=meta.choices or None,
                                metavar="N" if wanted is int else None, help=help)


def check_variables(args: argparse.Namespace) -> None:
    """A value that came from a variable must be one of its flag's choices (argparse checks a flag's
    value, not a default's): LoadError naming the variable."""
    for name, _, meta in specs():
        value = getattr(args, name)
        if meta.choices and value is not None and value not in meta.choices:
            raise LoadError(f"{meta.env}: {value!r} is not one of {', '.join(meta.choices)}")


def variables(cls=LoadSettings) -> list[tuple[str, str]]:
    """(the variable, as it is set; its flag) of every field of the schema `cls` (default: the load
    settings; the app's: app_ui/setup.py AppSettings): ("VLM_SHARE=1", "--share")."""
    return [(meta.env + ("=1" if wanted is bool else ""), flag(name)) for name, wanted, meta in specs_of(cls)]


class _Repeat(argparse.Action):
    """A repeatable flag whose values replace its default (its variable's) instead of adding to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, self.dest)
        setattr(namespace, self.dest, ([] if given is None or given is self.default else given) + [values])


def table(cls=LoadSettings) -> str:
    """The load settings (or another schema of flags and variables: the app's, app_ui/setup.py
    AppSettings) as a Markdown table (docs/settings.md holds it; a test keeps the two equal)."""
    rows = ["| flag | variable | default | choices or range | what it does |", "|---|---|---|---|---|"]
    for name, wanted, meta in specs_of(cls):
        value = cls.__dataclass_fields__[name].default
        bounds = ", ".join(meta.choices) if meta.choices else (
            f"{meta.low:g} to {meta.high_text or f'{meta.high:g}'}" if meta.low is not None else "")
        rows.append(f"| `{flag(name)}` | `{meta.env}` | `{value!r}` | {bounds} | {meta.help} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(table(), end="")
