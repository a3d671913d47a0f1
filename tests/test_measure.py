"""Every module of measure/ is named in docs/benchmarks.md's tools table and runs here: a command's
`--help` exits 0 with its usage, a library imports. A module added without either fails."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest

from tests.conftest import ROOT

MODULES = sorted(path.stem for path in pathlib.Path(ROOT, "measure").glob("*.py") if path.stem != "__init__")
LIBRARIES = {"bench_rows", "exactness", "llamacpp_rows", "shapes"}  # imported by the commands, no main()


def test_the_benchmarks_page_names_every_module_and_no_other():
    with open(f"{ROOT}/docs/benchmarks.md", encoding="utf-8") as page:
        text = page.read()
    tools = text.split("## The tools (`measure/`)")[1].split("\n## ")[0]
    named = re.findall(r"^\| `measure\.(\w+)` \|", tools, re.M)
    assert sorted(named) == MODULES
    assert not set(re.findall(r"\bmeasure\.(\w+)", text)) - set(MODULES), "docs/benchmarks.md names a module gone"


@pytest.mark.parametrize("name", MODULES)
def test_each_module_imports_and_each_command_says_its_usage(name, capsys):
    module = importlib.import_module(f"measure.{name}")
    if name in LIBRARIES:
        assert not hasattr(module, "main") and module.__doc__
        return
    with pytest.raises(SystemExit) as finished:
        code = module.main(["--help"])
        raise SystemExit(code)
    assert finished.value.code in (0, None)
    assert f"measure.{name}" in capsys.readouterr().out
