"""A family declares what it supports in its own file (models/families/): the fast path's text
model types, drafter heads on the fast path, GGUF quirks; the files that act on them name no family."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from models.families import REGISTRY, TEXT_LM, VLM_FAMILIES, family_of_type, fast_head_layers, fast_text_types
from tests.conftest import ROOT


def test_the_fast_path_covers_what_the_families_declare():
    from engine import fast_decode

    assert set(fast_text_types()) == set(fast_decode.TEXT_TYPES)
    assert fast_head_layers() == ("qwen2_vl",)  # engine/fast_heads.py: heads of Qwen2-VL layers
    assert {"llama", "qwen2"} <= set(TEXT_LM.fast_text_types)  # text-only drafters


def test_gguf_quirks_come_from_the_family():
    assert family_of_type("qwen2_5_vl").gguf_merger_blocks == 3 and family_of_type("gemma3").gguf_merger_blocks == 0
    assert family_of_type("smolvlm").gguf_text_architectures == ("VLlama3ForCausalLM",)
    assert family_of_type("not a family") is None


def family_words() -> set[str]:
    return {word for family in (*VLM_FAMILIES, TEXT_LM) for word in
            (family.name, *family.model_types, *family.fast_text_types)} | set(REGISTRY)


@pytest.mark.parametrize("path", ["models/gguf.py", "engine/fast_decode.py", "engine/fast_heads.py"])
def test_the_files_that_act_on_a_declaration_name_no_family(path):
    tree = ast.parse(Path(ROOT, path).read_text())
    named = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert not named & family_words(), f"{path} names {sorted(named & family_words())}: declare it in the family"
