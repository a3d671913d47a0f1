"""Drafters' own products in the compiled rows kernel (engine/fast_layer.cpp `product`): an
EAGLE-3 layer's Linear modules and the target's output head a drafter reads. ATen's one-row
16-bit products read the weight at about half the speed; the rows kernel reads it once for all
the rows of a pass (docs/performance.md, "Drafters' products")."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import fast_native


def rows_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (n, in) times weight (out, in) transposed, plus bias, as F.linear: in the compiled rows
    kernel where it builds and takes the pass (on a CPU, up to its most rows, x in the weight's
    dtype: one weight read for all the rows), else ATen's. For drafters' own products (an EAGLE-3
    layer, the target's output head a drafter reads), where ATen's one-row 16-bit products read
    the weight at about half the speed."""
    native = fast_native.layer() if weight.device.type == "cpu" else None
    if native is None or len(x) > native.rows_kernel_max or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    return native.product(x, weight.t(), bias)


class RowsKernelLinear(torch.nn.Linear):
    """An nn.Linear whose products run through `rows_product` (the compiled rows kernel where it
    builds and takes the pass, else ATen's); same parameters. A module that is to use it is built
    with it (models/eagle3.py `load(..., linear=RowsKernelLinear)`), never converted afterwards."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = rows_product(x.reshape(-1, self.in_features), self.weight, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)
