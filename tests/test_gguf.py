"""models/gguf.py: conversion to GGUF with llama.cpp's converter, cached by the source's hash."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import xllamacpp  # noqa: E402,F401  (in requirements.txt: a missing install fails here, never skips)

from models.gguf import ConversionError, converted, gpt2_pre_tokenizer, source_hash  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

TARGET = os.path.join(ROOT, "assets", "demo", "target")


def test_the_demo_tokenizer_pre_tokenizes_as_gpt2():
    with open(os.path.join(TARGET, "tokenizer.json"), encoding="utf-8") as file:
        tokenizer = json.load(file)
    assert gpt2_pre_tokenizer(tokenizer)
    tokenizer["pre_tokenizer"]["add_prefix_space"] = True  # a different rule: not GPT-2's
    assert not gpt2_pre_tokenizer(tokenizer)
    assert not gpt2_pre_tokenizer({**tokenizer, "pre_tokenizer": {"type": "Metaspace"}})


def test_conversion_is_cached_by_the_source_files(tmp_path):
    model, mmproj = converted(TARGET), converted(TARGET, mmproj=True)
    assert model.name == "model-f32.gguf" and mmproj.name == "mmproj-f32.gguf" and model.parent == mmproj.parent
    assert converted(TARGET) == model  # cached: no second conversion
    copy = shutil.copytree(TARGET, tmp_path / "target")
    assert source_hash(copy) == source_hash(TARGET)
    (copy / "generation_config.json").write_text("{}")
    assert source_hash(copy) != source_hash(TARGET)  # an edited source converts again


def test_a_folder_that_is_not_a_checkpoint_gives_a_one_line_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchModel"]}')
    with pytest.raises(ConversionError) as error:
        converted(tmp_path, cache=tmp_path / "cache")
    assert "\n" not in str(error.value) and str(tmp_path) in str(error.value)


@pytest.mark.parametrize("family", ["smolvlm", "qwen2_5_vl"])
def test_tiny_smolvlm_and_qwen2_5_vl_convert_with_their_projectors(zoo, tmp_path, family):
    """SmolVLM without text_config.architectures (adaptation 4) and a Qwen2.5-VL vision tower of
    depth 2 (adaptation 3): both halves convert."""
    source = zoo.dir(family)
    assert converted(source, cache=tmp_path).is_file() and converted(source, mmproj=True, cache=tmp_path).is_file()
