"""measure/kernels.py: every candidate kernel computes the product it is timed for (bfloat16
y = x W^T within bf16 rounding of a float64 product, for 1 and 5 rows)."""

from __future__ import annotations

import torch

from engine import fast_native
from measure import kernels

KINDS = ("in", "out") + tuple(f"compiled:{name}" for name in (fast_native.layer().rows_kernels_built()
                                                               if fast_native.layer() is not None else ()))


def test_every_kind_computes_the_bfloat16_product(one_thread):
    torch.manual_seed(0)
    # compiled: groups of 4 (AVX-512, portable) or 2 (AVX2) outputs and one tail output, 3 blocks of
    # 16 inputs
    weight = torch.randn(101, 48).bfloat16()
    for n in (1, 5):
        x = torch.randn(n, 48).bfloat16()
        exact = x.double() @ weight.double().t()
        for kind in KINDS:
            y = kernels.make(kind, weight)(x)
            assert y.dtype == torch.bfloat16 and y.shape == (n, 101), kind
            assert ((y.double() - exact).abs() <= exact.abs() * 2 ** -7 + 1e-3).all(), kind
