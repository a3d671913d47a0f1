"""The README's "where things go", tried: a model family added as one file of models/families/
is registered with nothing else touched, and a setting added as one field of `Settings` gets
its flag, its check, its sidebar control and its docs row from that field alone."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

import models.families as families
from engine import settings
from engine.engine import RequestError

TOY_FAMILY = '''
from models.families.base import Family

FAMILIES = (Family("toy_vl", ("toy_vl_type",), fast_text_types=("toy_text",)),)
'''


def test_a_family_is_one_file(tmp_path, monkeypatch):
    (tmp_path / "toy_vl.py").write_text(TOY_FAMILY)
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(tmp_path)])
    registry = families._registry()
    assert registry["toy_vl_type"].name == "toy_vl"
    assert set(registry) > set(families.REGISTRY)  # every family of the package, and the new one
    monkeypatch.setattr(families, "REGISTRY", registry)
    monkeypatch.setattr(families, "VLM_FAMILIES", tuple(dict.fromkeys(registry.values())))
    assert families.family_for_config(SimpleNamespace(model_type="toy_vl_type")).name == "toy_vl"
    assert "toy_text" in families.fast_text_types()  # what it declares reaches the fast path's list


def test_a_setting_is_one_field(monkeypatch):
    @dataclass(frozen=True)
    class WithOneMore(settings.Settings):
        patience: int = settings.setting(3, "rounds to wait", "Patience", low=0, high=9)

    monkeypatch.setattr(settings, "Settings", WithOneMore)
    assert settings.names()[-1] == "patience" and "patience" in settings.api_names()
    parser = argparse.ArgumentParser()
    settings.add_cli_args(parser)
    assert parser.parse_args(["--patience", "5"]).patience == 5 and parser.parse_args([]).patience == 3
    with pytest.raises(RequestError, match="patience"):
        settings.check_value("patience", 10)
    assert settings.control("patience") == {"label": "Patience", "info": "rounds to wait", "value": 3,
                                            "choices": None, "range": (0, 9, 1)}
    assert "| `patience` | `--patience` | `3` | 0 to 9 |" in settings.table()
