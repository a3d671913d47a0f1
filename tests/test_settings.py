"""One settings schema (engine/settings.py): every setting is a flag of `python -m engine`, a
parameter of /chat and /ab with the same name, default and range, and a refusal names it."""

from __future__ import annotations

import pathlib
import re

import pytest

from app_ui import layout, setup
from engine import load_settings
from engine import settings as schema
from engine.schema import specs_of
from engine.__main__ import main, parse_args
from tests.conftest import ROOT
from tests.helpers import reference_engine

RANGED = [name for name in schema.names() if schema.spec(name).low is not None]


@pytest.fixture(scope="module")
def api(zoo):
    """The /chat and /ab parameters, as gradio_client's view_api reads them: {endpoint: {name: parameter}}."""
    demo = layout.build_demo(reference_engine(zoo))
    info = demo.get_api_info()["named_endpoints"]
    return {endpoint: {p["parameter_name"]: p for p in info[endpoint]["parameters"]} for endpoint in ("/chat", "/ab")}


def test_every_setting_is_a_parameter_of_chat_and_ab_in_the_schemas_order(api):
    assert list(api["/chat"]) == ["message", *schema.api_names()]
    assert list(api["/ab"]) == ["message", *schema.api_names(mode=False)]
    assert {"top_k", "tree_branching", "draft_tree"} <= set(api["/chat"])


def test_the_apis_defaults_are_the_schemas_except_the_engines_own(api):
    engine_given = {"mode", "drafter", "max_image_tokens"}  # the loaded model's default drafter and image budget
    for endpoint, parameters in api.items():
        for name in set(parameters) - {"message"} - engine_given:
            assert parameters[name]["parameter_has_default"], (endpoint, name)
            assert parameters[name]["parameter_default"] == schema.default(name), (endpoint, name)


def test_every_setting_is_a_flag_with_the_schemas_default():
    args = parse_args(["a question"])
    for name in schema.names():
        assert hasattr(args, name), f"no {schema.flag(name)}"
        if schema.spec(name).cli:  # drafter, max_image_tokens: load flags of the same name (engine/build.py)
            assert getattr(args, name) == schema.default(name), name


@pytest.mark.parametrize("name", RANGED)
def test_values_out_of_range_are_refused_naming_the_setting_everywhere(name, capsys):
    meta = schema.spec(name)
    bad = [meta.low - 1] + ([meta.high + 1] if meta.high is not None else [])
    for value in bad:
        with pytest.raises(schema.RequestError, match=rf"^{name} must be .*, got {value}"):
            schema.Settings(**{name: value}).check()
        if meta.cli:  # the command line refuses it before loading anything, naming the setting, not its flag
            assert main(["hi", schema.flag(name), str(value)]) == 2
            assert capsys.readouterr().err.startswith(f"error: {name} must be ")
    edges = [meta.high] if meta.high is not None else []
    for value in edges + ([] if meta.above_low else [meta.low]):
        schema.Settings(**{name: value}).check()  # the range's ends are taken


def test_wrong_types_and_choices_name_the_setting():
    for changes, refusal in [(dict(draft_tree="5"), "draft_tree must be a whole number, got '5'"),
                             (dict(top_k=1.5), "top_k must be a whole number, got 1.5"),
                             (dict(mode="sideways"), "mode sideways is not in the list of choices (speculative, "
                                                     "plain)"),
                             (dict(drafter="nope"), "drafter nope is not in the list of choices (text, none)")]:
        with pytest.raises(schema.RequestError) as refused:
            schema.Settings(**changes).check(drafters=["text"])
        assert str(refused.value) == refusal


def test_the_docs_tables_are_the_schemas():
    with open(f"{ROOT}/docs/settings.md", encoding="utf-8") as page:
        text = page.read()
    assert schema.table() in text, "docs/settings.md: paste the output of python -m engine.settings"
    assert load_settings.table() in text, "docs/settings.md: paste the output of python -m engine.load_settings"
    assert load_settings.table(setup.AppSettings) in text, "docs/settings.md: paste load_settings.table(AppSettings)"


def test_the_security_page_lists_every_ceiling_and_limit_with_its_variable():
    """docs/security.md's bounds table: each server ceiling with its schema default and variable,
    each visitors' limit with its variable (engine/settings.py, app_ui/visitors.py)."""
    from dataclasses import fields

    from app_ui.visitors import Limits

    with open(f"{ROOT}/docs/security.md", encoding="utf-8") as page:
        rows = [line for line in page.read().splitlines() if line.startswith("| ")]
    for option in fields(schema.Ceilings):
        meta = schema.spec(option.name)
        row = next(line for line in rows if line.startswith(f"| `{option.name}` |"))
        assert f" to {meta.ceiling}" in row and f"`{meta.ceiling_env}`" in row, row
    for name, _, meta in specs_of(Limits):
        assert any(f"`{meta.env}`" in line for line in rows), meta.env


def test_every_variable_is_read_by_one_reader_with_one_kind_of_message():
    """engine/schema.py `environ_values` reads the load settings', the ceilings' and the visitors'
    variables alike: a number of the field's kind, in its range, named in one line."""
    from app_ui.visitors import Limits

    cases = [(schema.Ceilings.from_environ, "VLM_MAX_DRAFT_TOKENS", schema.RequestError),
             (Limits.from_environ, "VLM_SESSIONS_PER_CLIENT", ValueError),
             (lambda environ: setup.app_parser(environ), "VLM_MAX_IMAGE_TOKENS", setup.SetupError)]
    for read, variable, error in cases:
        for text, says in [("many", f"{variable}: 'many' is not a whole number"), ("-1", f"{variable}: -1 is under")]:
            with pytest.raises(error) as refused:
                read({variable: text})
            assert str(refused.value).startswith(says), str(refused.value)
    assert schema.Ceilings.from_environ({"VLM_MAX_DRAFT_TOKENS": "8"}).draft_tokens == 8
    for variable, text, says in [("VLM_PORT", "abc", "VLM_PORT: 'abc' is not a whole number"),
                                 ("VLM_PORT", "0", "VLM_PORT: 0 is under 1"),
                                 ("GRADIO_SERVER_PORT", "70000", "GRADIO_SERVER_PORT: 70000 is over 65535"),
                                 ("VLM_MAX_IMAGES", "65", "VLM_MAX_IMAGES: 65 is over 64")]:
        with pytest.raises(setup.SetupError, match=f"^{says}$"):
            setup.read_config([], {variable: text})
    assert setup.app_settings({"VLM_HOST": "::1", "GRADIO_SERVER_NAME": "x", "VLM_SHARE": "yes", "SPACE_ID": "a/b",
                               "GRADIO_SERVER_PORT": "9000", "VLM_MAX_IMAGES": "3"}) == setup.AppSettings(
        host="::1", port=9000, share=True, no_browser=True, max_images=3)
    assert Limits.from_environ({"VLM_TIME_BUDGET_S": "60"}, proxy_hops=1) == Limits(time_budget_s=60.0, proxy_hops=1)
    with pytest.raises(ValueError, match="VLM_TIME_BUDGET_S: 'nan' is not a finite number"):
        Limits.from_environ({"VLM_TIME_BUDGET_S": "nan"})


def test_the_schema_gives_what_a_sidebar_control_needs():
    """`control`: label, help, default, and choices or (least, most, step): the sidebar can be made from it."""
    assert schema.control("mode")["choices"] == schema.MODES
    assert schema.control("draft_tree")["range"] == schema.spec("draft_tree").ui
    assert schema.control("seed")["range"] == (0, 2**63 - 1, 1)
    for name in schema.names():
        shown = schema.control(name)
        assert shown["label"] and shown["info"] and shown["value"] == schema.default(name), name


# --- the load settings (engine/load_settings.py): flags of every command, VLM_* variables of the app -----

def test_every_load_setting_is_a_flag_and_a_variable_of_the_app_with_help():
    parser = setup.app_parser({})
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help"
    for name, _, meta in load_settings.specs():
        assert meta.env == "VLM_" + name.upper() and meta.help
        assert schema.flag(name) in parser._option_string_actions


def test_the_apps_help_lists_every_variable_the_code_reads(capsys):
    with pytest.raises(SystemExit):
        setup.read_config(["--help"], {})
    listing = capsys.readouterr().out.split("environment variables")[1]
    read = set()
    for folder in ("app_ui", "engine", "models"):
        for path in pathlib.Path(ROOT, folder).rglob("*.py"):
            read |= set(re.findall(r"\bVLM_[A-Z_]*[A-Z]\b", path.read_text())) - {"VLM_FAMILIES"}  # a tuple
    read |= {meta.env for _, _, meta in load_settings.specs()}
    assert {"VLM_DECODE_SLOTS", "VLM_TIME_BUDGET_S", "VLM_MAX_DRAFT_TREE", "VLM_BACKEND_API_KEY"} <= read
    assert not [name for name in read if not re.search(rf"^  (.*, )?{name}\b", listing, re.M)]


def test_the_switches_are_schema_fields_read_by_the_one_reader_and_listed_by_help(capsys):
    """engine/schema.py Switches: each switch's variable, set to its other value, turns it over
    (read by `from_environ`, "0" off and "1" on); `python app.py --help` and docs/settings.md list
    each with its help; the modules that use them read no variable themselves."""
    from dataclasses import fields

    from engine.schema import Switches, switch_table, switch_variables, switches

    defaults = switches({})
    assert defaults == Switches() and defaults.native_layer and not defaults.native_avx2
    for option, (variable_as_set, _) in zip(fields(Switches), switch_variables()):
        variable, value = variable_as_set.split("=")
        assert getattr(switches({variable: value}), option.name) is not option.default, variable_as_set
        assert getattr(switches({variable: "1" if value == "0" else "0"}), option.name) is option.default
    with pytest.raises(SystemExit):
        setup.read_config(["--help"], {})
    listing = " ".join(capsys.readouterr().out.split("environment variables")[1].split())
    for variable_as_set, what in switch_variables():
        assert f"{variable_as_set} {' '.join(what.split())}" in listing, variable_as_set
    with open(f"{ROOT}/docs/settings.md", encoding="utf-8") as page:
        assert switch_table() in page.read(), "docs/settings.md: paste the output of python -m engine.schema"
    for module in ("engine/fast_native.py", "engine/packed.py", "engine/huge_pages.py",
                   "engine/backends/llamacpp_process.py"):
        assert not re.search(r"environ(\.get|\[)", pathlib.Path(ROOT, module).read_text()), module


@pytest.mark.parametrize("environ,error", [
    ({"VLM_MAX_IMAGE_TOKENS": "many"}, "VLM_MAX_IMAGE_TOKENS: 'many' is not a whole number"),
    ({"VLM_MAX_IMAGE_TOKENS": "-1"}, "VLM_MAX_IMAGE_TOKENS: -1 is under 0"),
    ({"VLM_DTYPE": "float64"}, "VLM_DTYPE: 'float64' is not one of fit, float32, bfloat16, float16, auto"),
    ({"VLM_QUANTIZATION": "3bit"}, "VLM_QUANTIZATION: '3bit' is not one of 4bit, 8bit, int8, w8a8, q4_0"),
])
def test_a_bad_variable_is_one_line_naming_it_and_a_flag_wins_over_a_bad_choice(environ, error):
    with pytest.raises(setup.SetupError) as refused:
        setup.read_config([], environ)
    assert str(refused.value) == error
    name = next(iter(environ))[4:].lower()
    if name != "max_image_tokens":  # a number is read as the flags are made, a choice after parsing
        flag_value = {"dtype": "float32", "quantization": "8bit"}[name]
        assert getattr(setup.read_config([schema.flag(name), flag_value], environ).spec.options, name) == flag_value


def test_a_server_ceiling_above_the_settings_range_is_refused_at_start():
    from engine.engine import Ceilings, RequestError
    from engine.settings import spec

    most = int(spec("draft_tree").high)
    assert Ceilings.from_environ({"VLM_MAX_DRAFT_TREE": str(most)}).draft_tree == most
    with pytest.raises(RequestError, match=rf"VLM_MAX_DRAFT_TREE: {most + 1} is over the most the settings allow \({most}\)"):
        Ceilings.from_environ({"VLM_MAX_DRAFT_TREE": str(most + 1)})
