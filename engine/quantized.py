"""The fast path's quantized weights (`--quantization int8`, `w8a8`, `q4_0`), and the readable
reference of their products (engine/fast_layer.cpp and its headers compute the same,
tests/test_fast_native.py, tests/test_w8a8.py, tests/test_q4.py).

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

- `Q4Weight` (q4_0): llama.cpp's Q4_0 weights (blocks of 32 values along the input, a float16
  scale and 4-bit codes each, quantized as llama.cpp's `quantize_row_q4_0_ref`), times W8A8's int8
  activation rows; the products are summed exactly in int32 lanes of 4 values and those lanes in
  float32 in a fixed order (`Q4Weight.float_product`), so again a row never depends on the rows
  beside it, the threads or the kernel (engine/fast_q4.h).

int8 weights and activations are symmetric: a row's largest |value| becomes 127 (-127 .. 127).
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, fields

import torch

from engine.packed import Adapted, PackedWeight

log = logging.getLogger(__name__)

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


@dataclass
class Q4Weight:
    """A weight (out, in) in llama.cpp's Q4_0 format: for each block of 32 inputs of an output row a
    float16 scale d and codes q in 0 .. 15, the weight (q - 8) * d. Stored for engine/fast_q4.h:
    the input padded to a multiple of 64 (padding: code 8, scale 0); the codes of each 128 inputs
    packed in 64 bytes, byte j holding input j in its low 4 bits and input 64 + j in its high 4 bits,
    and of a last 64 (a width of 64 past a multiple of 128) in 32 bytes, input j and 32 + j: one
    load and two masks give 64 codes in order (llama.cpp packs inputs j and 16 + j of each block; the
    same codes and scales)."""

    codes: torch.Tensor  # (out, padded_in / 2) uint8
    scales: torch.Tensor  # (out, padded_in / 32) float16
    width: int  # in

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Q4Weight:
        """weight (in, out), any float dtype, in a multiple of 32 (Q4_0's blocks)."""
        width, out = weight.shape
        if width % Q4_BLOCK:
            raise ValueError(f"q4_0 weights need an input width that is a multiple of {Q4_BLOCK}, not {width}")
        padded = -(-width // 64) * 64
        codes = torch.full((out, padded), 8, dtype=torch.uint8)
        scales = torch.zeros(out, padded // Q4_BLOCK, dtype=torch.float16)
        for start in range(0, out, QUANTIZE_ROWS):  # a block of rows at a time: float32 copies stay small
            rows = weight[:, start:start + QUANTIZE_ROWS].t().float()
            block_codes, block_scales = quantize_q4_0(rows)
            codes[start:start + len(rows), :width] = block_codes
            scales[start:start + len(rows), :width // Q4_BLOCK] = block_scales
        packed = [(halves[:, :, 0] | halves[:, :, 1] << 4).reshape(out, -1) for halves in packed_groups(codes)]
        return cls(torch.cat(packed, dim=1), scales, width)

    def values(self) -> torch.Tensor:
        """The signed values q - 8, (out, padded_in) int8, unpacked."""
        out, pairs = len(self.codes), self.codes.shape[1] // 64
        groups = [self.codes[:, :64 * pairs].view(out, pairs, 64), self.codes[:, 64 * pairs:].view(out, -1, 32)]
        return torch.cat([torch.cat([g & 15, g >> 4], dim=2).reshape(out, -1) for g in groups], dim=1).to(torch.int8) - 8

    def float_product(self, x: torch.Tensor) -> torch.Tensor:
        """x (n, in) times this weight, (n, out) float32, as engine/fast_q4.h computes it (bitwise):
        x's int8 rows (`quantize_rows`, padded with 0). For each 64 inputs (a step) and output, 16
        lanes of 4 consecutive inputs: the lane's exact integer sum of value x (q - 8), times its
        block's scale (exact in float32: 12 bits times float16's 11), added to the lane's float32
        total, step after step; the 16 totals then added in halves (8 + 8, 4 + 4, 2 + 2, 1 + 1),
        times the row's scale."""
        rows, row_scales = quantize_rows(x)
        padded = 2 * self.codes.shape[1]
        rows = torch.nn.functional.pad(rows, (0, padded - rows.shape[1])).double().view(len(x), -1, 16, 4)
        values = self.values().double().view(len(self.codes), -1, 16, 4)
        lane_scales = self.scales.float().repeat_interleave(8, dim=1).view(len(self.codes), -1, 16)
        lanes = torch.zeros(len(x), len(self.codes), 16)
        for step in range(rows.shape[1]):  # (n, 16, 4) . (out, 16, 4) per lane: exact integers
            sums = torch.einsum("nlk,olk->nol", rows[:, step], values[:, step]).float()
            lanes = lanes + sums * lane_scales[:, step]
        while lanes.shape[-1] > 1:
            lanes = lanes[..., :lanes.shape[-1] // 2] + lanes[..., lanes.shape[-1] // 2:]
        return lanes[..., 0] * row_scales[:, None]


Q4_BLOCK = 32  # inputs per Q4_0 scale


def packed_groups(codes: torch.Tensor) -> list[torch.Tensor]:
    """codes (out, padded) in input order: each 128 inputs as (out, groups, 2, 64) halves, and the last
    64 (if any) as (out, 1, 2, 32): what Q4Weight packs into the low and high 4 bits of a byte."""
    out, pairs = len(codes), codes.shape[1] // 128
    return [codes[:, :128 * pairs].reshape(out, pairs, 2, 64), codes[:, 128 * pairs:].reshape(out, -1, 2, 32)]


def quantize_q4_0(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows (out, in) float32, in a multiple of 32: codes (out, in) uint8 in 0 .. 15 and float16
    scales (out, in / 32), as llama.cpp's quantize_row_q4_0_ref (ggml/src/ggml-quants.c) and
    gguf-py's Q4_0 compute them: in each block the value of largest |x| (the first of equals) m,
    d = m / -8, codes min(15, trunc(x * (1 / d) + 8.5)) in float32 (0 where d is 0), d stored as
    float16 (rounded to nearest even)."""
    blocks = rows.reshape(len(rows), -1, Q4_BLOCK)
    top = blocks.gather(2, blocks.abs().argmax(dim=2, keepdim=True))  # argmax: the first of equals
    d = top / -8
    inverse = torch.where(d == 0, torch.zeros_like(d), torch.div(torch.ones_like(d), d))
    codes = torch.trunc(blocks * inverse + 8.5).clamp(max=15).to(torch.uint8)
    return codes.reshape(rows.shape), d[..., 0].to(torch.float16)


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


def quantized_linear(x: torch.Tensor, weight: Int8Weight | Q4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x (n, in) times a quantized weight, plus bias (n, out): fast_decode.linear's quantized case."""
    if isinstance(weight, (W8A8Weight, Q4Weight)):  # the bias added in float32, then one rounding to x's dtype
        y = weight.float_product(x)
        return (y if bias is None else y + bias.float()).to(x.dtype)
    y = torch._weight_int8pack_mm(x, weight.values, weight.scales)
    return y if bias is None else y + bias


QUANTIZED = {"int8": Int8Weight, "w8a8": W8A8Weight, "q4_0": Q4Weight}  # --quantization: the fast path's weights


def native_weight(native, weight):
    """A product's weight as the compiled stack takes it (native.Weight): (in, out) values, and
    the int8 scales of an Int8Weight (and a W8A8Weight's sums: int8 activations); a Q4Weight's
    codes and block scales; a PackedWeight's blocks (and an Adapted one's low-rank update), with
    integer rows' kernel where its arithmetic is integer (engine/fast_blocks.h)."""
    if isinstance(weight, (Adapted, PackedWeight)):  # the blocks, and integer rows' kernel where chosen
        base = weight.base if isinstance(weight, Adapted) else weight
        integer_rows = base.kernel if base.arithmetic == "integer" else None
        return native.Weight(base.blocks, down=getattr(weight, "down", None), up=getattr(weight, "up", None),
                             integer_rows=integer_rows)
    if isinstance(weight, Q4Weight):
        return native.Weight(weight.codes, weight.scales)
    if isinstance(weight, Int8Weight):
        sums = weight.sums if isinstance(weight, W8A8Weight) else None
        return native.Weight(weight.values.t(), weight.scales, sums)
    return native.Weight(weight)


def native_layer(native, layer):
    """A fast_decode.Layer as the compiled stack takes it: native.Layer, the Layer's fields by name
    (engine/fast_layer.cpp), each product's weight a native.Weight."""
    values = {f.name: getattr(layer, f.name) for f in fields(layer)}
    return native.Layer(**{name: native_weight(native, value) if name.endswith("_weight") else value
                           for name, value in values.items()})


def log_slow_path(weights: list) -> None:
    """Name the compiled products no kernel of the format table takes (engine/fast_layer.cpp
    `storage_of`: they run ATen's product), once each time such weights are made."""
    slow = collections.Counter(w.storage for w in weights if w.storage.startswith("aten"))
    for why, count in slow.items():
        log.warning("%d product(s) of the compiled decode path take the slow path: %s", count, why)
