"""The CPU path's format table (engine/fast_layer.cpp `storage_of` / `product_by`): each weight is
recognised once, when it is made, as one entry; a weight no kernel takes is named as ATen's slow
path (and logged by engine/quantized.py `log_slow_path`), never found only by timing."""

from __future__ import annotations

import logging

import torch

from engine import fast_native
from engine.quantized import log_slow_path
from tests.test_fast_native import NO_COMPILER
from tests.test_integer_rows import gguf_blocks


@NO_COMPILER
def test_each_weight_is_one_entry_of_the_table():
    native = fast_native.layer()
    rows = torch.randn(48, 64)  # (out, in)
    assert native.Weight(rows.t()).storage == "rows"  # (in, out) view of an (out, in) buffer
    assert native.Weight(rows.to(torch.int8).t(), torch.rand(48)).storage == "rows"  # int8 with scales
    assert native.Weight(rows.to(torch.int8).t(), torch.rand(48), torch.zeros(48, dtype=torch.int32)).storage == \
        "int8 activations"
    blocks = gguf_blocks(48, 64, "q4_1", seed=1)
    assert native.Weight(blocks).storage == "blocks"
    assert native.Weight(blocks, integer_rows="").storage == "integer blocks"
    assert native.Weight(rows.t().contiguous()).storage.startswith("aten: the rows kernel takes (in, out) views")
    assert native.Weight(torch.randn(40, 48)[:, :40].t()).storage.startswith("aten")  # in not a multiple of 16
    assert native.Weight(rows.double().t()).storage == "aten: no rows kernel for Double weights"


@NO_COMPILER
def test_the_slow_path_computes_the_product_and_is_named(caplog):
    native = fast_native.layer()
    weight = torch.randn(64, 48)  # (in, out) contiguous: no kernel reads it
    x = torch.randn(3, 64)
    assert torch.allclose(native.product(x, weight, None), x @ weight, atol=1e-5)
    with caplog.at_level(logging.WARNING, logger="engine.quantized"):
        log_slow_path([native.Weight(weight), native.Weight(weight), native.Weight(torch.randn(48, 64).t())])
    assert [r.getMessage() for r in caplog.records] == [
        "2 product(s) of the compiled decode path take the slow path: aten: the rows kernel takes (in, out) views "
        "of (out, in) buffers, in a multiple of 16"]
