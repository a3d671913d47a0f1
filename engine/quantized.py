"""The fast path's int8 weights (`--quantization int8`, `--quantization w8a8`), and the readable
reference of their products (engine/fast_layer.cpp computes the same, tests/test_fast_native.py).

- `Int8Weight` (int8): int8 values with one scale per output row; the activations stay in their
  float dtype, so each product converts the weights to float (torch's `_weight_int8pack_mm`, or
  the compiled rows kernel).
- `W8A8Weight` (w8a8): the same weights, and the activations too are made int8 before each
  product, one scale per row of activations (`quantize_rows`), so the product is a sum of int8 x
  int8 terms in int32 (AVX512-VNNI `vpdpbusd` in engine/fast_layer.cpp), exact: no order of
  summation changes it, so a row's result never depends on the rows beside it, the threads or the
  kernel, and a verify pass is bitwise its decode passes. Then one float epilogue per output,
  the same for every row: float(sum) * weight scale * row scale (+ bias), rounded once to the
  activations' dtype. llama.cpp's Q8_0 decode does the same with a scale per 32 values.

Both are symmetric: a row's largest |value| becomes 127 (-127 .. 127; -128 is never used).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QUANTIZE_ROWS = 4096  # rows of a weight quantized at once (a 2048-wide block: 32 MB of float32)


@dataclass
class Int8Weight:
    """A weight (out, in) as int8 values with one scale per output row (symmetric: the row's
    largest |w| becomes 127), in the layout torch's CPU kernel `_weight_int8pack_mm` reads.
    Half the bytes of bfloat16, so a bandwidth-bound product can run up to twice as fast."""

    values: torch.Tensor  # (out, in) int8
    scales: torch.Tensor  # (out,) in the activations' dtype

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        """weight (in, out), as `linear` takes it, any float dtype; the scales keep its dtype."""
        if weight.dtype == torch.bfloat16 and weight.shape[0] % 16:
            # torch 2.13's bfloat16 kernel reads past the row (wrong values, or a crash) otherwise
            raise ValueError(f"int8 weights in bfloat16 need an input width that is a multiple of 16, not "
                             f"{weight.shape[0]}")
        return cls(*quantize_weight(weight))


@dataclass
class W8A8Weight(Int8Weight):
    """Int8Weight's values and scales, multiplied by int8 activations (`quantize_rows`)."""

    sums: torch.Tensor | None = None  # (out,) int32: each row's sum of values (the VNNI kernel's offset correction)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> W8A8Weight:
        """weight (in, out), any float dtype (Int8Weight.quantize's values and scales)."""
        values, scales = quantize_weight(weight)  # any width: engine/fast_int8.h reads it, not torch's kernel
        return cls(values, scales, values.sum(dim=1, dtype=torch.int32))

    def float_product(self, x: torch.Tensor) -> torch.Tensor:
        """x (n, in) times this weight, (n, out) float32, as engine/fast_layer.cpp computes it
        (bitwise): the int8 rows of x times the int8 values, summed exactly (in float64: every
        partial sum is an integer below 2^53), then float32(sum) * weight scale * row scale."""
        values, row_scales = quantize_rows(x)
        sums = values.double() @ self.values.double().t()  # (n, out), exact integers
        return sums.float() * self.scales.float() * row_scales[:, None]


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (in, out), any float dtype: int8 values (out, in) and scales (out,) in its dtype, each
    output row on its own (symmetric, the row's largest |w| becomes 127)."""
    weight = weight.t()  # (out, in)
    values = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=weight.dtype, device=weight.device)
    for start in range(0, len(weight), QUANTIZE_ROWS):  # a block of rows at a time: float32 copies stay small
        rows = weight[start:start + QUANTIZE_ROWS].float()
        block_scales = (rows.abs().amax(dim=1) / 127).clamp(min=1e-12).to(weight.dtype)
        values[start:start + len(rows)] = (rows / block_scales.float()[:, None]).round().clamp(-127, 127)
        scales[start:start + len(rows)] = block_scales
    return values, scales


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (n, in), any float dtype: int8 values (n, in) and float32 scales (n,), each row on its own:
    scale = the row's largest |x| / 127 (1 for a row of zeros), value = x / scale rounded to the
    nearest integer (halves to even), in float32."""
    rows = x.float()
    top = rows.abs().amax(dim=1)
    scales = torch.where(top > 0, top / 127, torch.ones_like(top))
    return (rows / scales[:, None]).round().clamp(-127, 127).to(torch.int8), scales


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x (n, in) times an int8 weight, plus bias (n, out): fast_decode.linear's int8 case."""
    if isinstance(weight, W8A8Weight):  # the bias added in float32, then one rounding to x's dtype
        y = weight.float_product(x)
        return (y if bias is None else y + bias.float()).to(x.dtype)
    y = torch._weight_int8pack_mm(x, weight.values, weight.scales)
    return y if bias is None else y + bias
