"""Float32 weights that came from a GGUF file's 4-bit or 8-bit blocks, kept in those blocks.

A model loaded from a GGUF file (the SmolLM2 demo's language model: `SmolLM2-135M-Instruct.Q4_1.gguf`)
holds float32 weights that gguf-py's `dequantize` made from ggml blocks of 32 inputs:

    Q4_1: value i = float(d) * q_i + float(m)    (d, m float16; q_i in 0 .. 15; two roundings)
    Q8_0: value i = float(d) * q_i               (d float16; q_i in -128 .. 127)

`pack` finds such blocks for a float32 weight, checking that every block gives back the weight's
values bit for bit, and returns them in ggml's layout (`block_q4_1`: d, m, 16 bytes of codes;
`block_q8_0`: d, 32 codes); None where any block does not (the weight stays float32). The
compiled rows kernel (engine/fast_layer.cpp, `BlockQ4_1` / `BlockQ8_0`) computes each block's
values as above and then the float32 products' multiply-adds in their order, so a product over
blocks is bitwise the product over the float32 weight, from a fifth (Q4_1: 20 bytes a block
against 128) or a quarter (Q8_0: 34) of the bytes a decode pass streams. Nothing is approximated:
an answer is the float32 answer, token for token (tests/test_packed.py).

The fast path packs a float32 model's decoder weights and output layer when it builds its
compiled stack (engine/fast_decode.py); VLM_PACKED_WEIGHTS=0 keeps them float32 (to compare).

With `--weight-arithmetic integer` the same blocks are multiplied as llama.cpp multiplies them:
x's rows made int8 per block of 32, exact integer sums per block, one float epilogue per block
(`integer_product`, the reference; engine/fast_blocks.h, the kernels, bitwise). Not the float32
answer any more, but every pass computes each row alone, so a verify pass is still bitwise its
decode passes and speculative greedy answers are still the plain ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from engine import huge_pages
from engine.schema import switches

BLOCK = 32
FORMATS = {"q4_0": 18, "q4_1": 20, "q8_0": 34}  # bytes a block, ggml's block_q4_0, block_q4_1 and block_q8_0
# A product over blocks multiplies x's float32 rows by the blocks' float32 values (bitwise the float32
# weight's product), or x's rows made int8 block by block by the blocks' codes (`integer_product`):
# --weight-arithmetic (engine/load_settings.py).
ARITHMETICS = ("float", "integer")
D_STEPS = (0, 1, -1, 2, -2)  # float16 neighbours of the estimated d tried, in this order


@dataclass
class PackedWeight:
    """A float32 weight (in, out) and the same values as ggml blocks (out, in / 32, bytes)."""

    weight: torch.Tensor  # (in, out) float32, as fast_decode.linear takes it (the model's own values)
    blocks: torch.Tensor  # (out, in / 32, FORMATS[format]) uint8
    format: str  # "q4_1" or "q8_0"
    arithmetic: str = "float"  # ARITHMETICS: float32 rows (the float32 product's bits) or int8 rows (integer_product)
    kernel: str = ""  # integer rows: engine/fast_blocks.h's kernel by name ("": the widest built; all give the same bits)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()


@dataclass
class Adapted:
    """A PackedWeight plus a low-rank update computed on its own: x (n, in) gives
    x base + (x down) up, never a merged weight (the merged values are not in any blocks)."""

    base: PackedWeight
    down: torch.Tensor  # (in, rank) float32, a transposed view of a (rank, in) buffer; rank a multiple of 16
    up: torch.Tensor  # (rank, out) float32, a transposed view of an (out, rank) buffer


def enabled() -> bool:
    return switches().packed_weights


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """`weight` (in, out) float32 in Q4_1 or Q8_0 blocks along `in`, when every block gives back
    its values bit for bit; else None."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.shape[0] % BLOCK:
        return None
    rows = weight.t().contiguous()  # (out, in)
    values = rows.reshape(-1, BLOCK)
    for format, find in (("q4_1", _q4_1), ("q8_0", _q8_0)):
        if find(values[:64]) is None:  # most weights are neither: decide on a few blocks first
            continue
        blocks = find(values)
        if blocks is not None:
            return PackedWeight(weight, blocks.reshape(rows.shape[0], -1, FORMATS[format]), format)
    return None


def adapt(layers: list, deltas: dict[str, torch.Tensor], fused: dict[str, tuple[str, ...]]) -> list | None:
    """fast_decode's Layers (packed) with the low-rank updates of models/picture_weights.py (`deltas`:
    {"...layers.<i>.self_attn.q_proj.lora_A": (rank, in), "...lora_B": (out, rank)}) as Adapted
    weights, fused as the layers fuse their projections (`fused`: fast_decode.FUSED); None unless
    every updated product's weight is packed."""
    parts = {}  # (layer, projection) -> {"A": lora_A, "B": lora_B}
    for key, tensor in deltas.items():
        found = re.search(r"layers\.(\d+)\.((?:self_attn|mlp)\.[a-z_]+_proj)\.lora_([AB])$", key)
        parts.setdefault((int(found[1]), found[2]), {})[found[3]] = tensor.float()
    adapted = []
    for index, layer in enumerate(layers):
        changes = {}
        for name, projections in fused.items():
            updates = [parts.get((index, p)) for p in projections]
            if not any(updates):
                continue
            base = getattr(layer, name)
            if not isinstance(base, PackedWeight) or not all(updates):
                return None
            down = torch.cat([u["A"] for u in updates])  # (sum rank, in)
            up = torch.block_diag(*[u["B"] for u in updates])  # (out, sum rank)
            rank = -(-down.shape[0] // 16) * 16  # zero rows and columns: the rows kernel's 16 lanes
            down = torch.cat([down, down.new_zeros(rank - down.shape[0], down.shape[1])])
            up = torch.cat([up, up.new_zeros(up.shape[0], rank - up.shape[1])], dim=1)
            changes[name] = Adapted(base, down.t(), up.t())
        adapted.append(replace(layer, **changes))
    return adapted


def values(weight):
    """A PackedWeight's float32 values (in, out); any other weight as it is."""
    return weight.weight if isinstance(weight, PackedWeight) else weight


def with_arithmetic(weight, arithmetic: str, kernel: str = ""):
    """A PackedWeight (or an Adapted one's base) multiplied with `arithmetic` (ARITHMETICS; integer
    rows by `kernel`), the same blocks; any other weight as it is."""
    if arithmetic not in ARITHMETICS:
        raise ValueError(f"weight arithmetic {arithmetic!r} is not one of {', '.join(ARITHMETICS)}")
    if isinstance(weight, Adapted):
        return replace(weight, base=with_arithmetic(weight.base, arithmetic, kernel))
    return replace(weight, arithmetic=arithmetic, kernel=kernel) if isinstance(weight, PackedWeight) else weight


def place(weights: list[PackedWeight]) -> None:
    """Move the weights' blocks onto 2 MB pages (engine/huge_pages.py), in one buffer."""
    arena = huge_pages.arena_for([w.blocks for w in weights])
    for weight in weights:
        weight.blocks = arena.place(weight.blocks) if arena is not None else weight.blocks


def unpack(blocks: torch.Tensor, format: str) -> torch.Tensor:
    """The float32 values (out, in) of ggml blocks (out, in / 32, bytes), as gguf-py computes them:
    float(d) * q (+ float(m) for Q4_1, a second rounding; q - 8 for Q4_0)."""
    out, count, _ = blocks.shape
    codes, d, m = block_fields(blocks, format)
    values = d[..., None] * codes.float()
    return (values + m[..., None] if format == "q4_1" else values).reshape(out, count * BLOCK)


def linear(x: torch.Tensor, weight: PackedWeight | Adapted, bias: torch.Tensor | None, float_linear) -> torch.Tensor:
    """fast_decode.linear (`float_linear`) for weights in blocks: x (n, in) times the float32 values,
    or `integer_product` for integer arithmetic, plus bias; an Adapted weight's update on its own."""
    if isinstance(weight, Adapted):
        return linear(x, weight.base, bias, float_linear) + float_linear(float_linear(x, weight.down), weight.up)
    if weight.arithmetic == "integer":
        y = integer_product(x, weight.blocks, weight.format)
        return y if bias is None else y + bias
    return float_linear(x, weight.weight, bias)


def integer_product(x: torch.Tensor, blocks: torch.Tensor, format: str) -> torch.Tensor:
    """x (n, in) float32 times ggml blocks (out, in / 32, bytes) with x made int8 block by block,
    (n, out) float32, as engine/fast_blocks.h computes it (bitwise; its header states the steps):
    per block the exact integer sum of q_w x q_x, then for each output, blocks in input order,
    total = total + (float(sum) * (d_w * d_x) [+ m_w * s_x for Q4_1])."""
    values, scales, sums = quantize_blocks(x)
    codes, d, m = block_fields(blocks, format)  # (out, blocks, 32) int32, (out, blocks) float32 twice
    n, count = scales.shape
    block_sums = torch.einsum("nbk,obk->nob", values.view(n, count, BLOCK).int(), codes)  # exact integers
    scaled_sums = scales * sums.float()
    total = torch.zeros(n, len(codes))
    for b in range(count):  # blocks in input order
        term = block_sums[:, :, b].float() * (d[None, :, b] * scales[:, b, None])
        if format == "q4_1":
            term = term + m[None, :, b] * scaled_sums[:, b, None]
        total = total + term
    return total


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (n, in) float32, in a multiple of 32: int8 values (n, in), d_x (n, in / 32) float32 and each
    block's sum of values (n, in / 32) int32: per block of 32, top = its largest |x|, d_x = top / 127,
    value = x * (127 / top) (0 for a block of zeros) rounded to the nearest integer, halves to even."""
    blocks = x.float().reshape(len(x), -1, BLOCK)
    top = blocks.abs().amax(dim=2)
    inverse = torch.where(top > 0, torch.div(torch.full_like(top, 127.0), top), torch.zeros_like(top))
    values = torch.mul(blocks, inverse[..., None]).round().clamp(-127, 127).to(torch.int8)
    return values.reshape(x.shape), torch.div(top, torch.full_like(top, 127.0)), values.sum(dim=2, dtype=torch.int32)


def block_fields(blocks: torch.Tensor, format: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml blocks (out, count, bytes) as (weight codes (out, count, 32) int32 in input order, the
    integers each block's d multiplies: q - 8 for Q4_0; d (out, count) float32; m, zeros but for Q4_1)."""
    out, count, size = blocks.shape
    d = blocks[..., :2].contiguous().view(torch.float16).float()[..., 0]
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()[..., 0] if format == "q4_1" else torch.zeros_like(d)
    if format == "q8_0":
        return blocks[..., 2:].contiguous().view(torch.int8).int(), d, m
    nibbles = blocks[..., size - 16:]
    codes = torch.cat([nibbles & 15, nibbles >> 4], dim=2).int()
    return (codes - 8 if format == "q4_0" else codes), d, m


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.view(torch.int32) == b.view(torch.int32)


def _codes(values: torch.Tensor, d: torch.Tensor, offset: torch.Tensor | None, low: int, high: int):
    """Per block (n, 32): codes q with d * q (+ offset) == values bit for bit, the rounded quotient
    or, where it misses, one of its two neighbours; (codes, blocks where every value has one)."""
    base = values if offset is None else values - offset
    codes = torch.nan_to_num(base / d, nan=0.0, posinf=0.0, neginf=0.0).round_().clamp_(low, high)
    found = _same_bits(_rebuilt(codes, d, offset), values)
    missed = (~found.all(dim=1)).nonzero().squeeze(1)  # blocks to look at again: few, if any
    if missed.numel():
        part, part_found = codes[missed], found[missed]
        part_d, part_offset = d[missed], None if offset is None else offset[missed]
        for step in (-1.0, 1.0):
            q = (codes[missed] + step).clamp(low, high)
            new = _same_bits(_rebuilt(q, part_d, part_offset), values[missed]) & ~part_found
            part, part_found = torch.where(new, q, part), part_found | new
        codes[missed], found[missed] = part, part_found
    return codes, found.all(dim=1)


def _rebuilt(codes: torch.Tensor, d: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """gguf-py's dequantize: float32 d * q, then + offset (two roundings)."""
    return d * codes if offset is None else d * codes + offset


def _find(values: torch.Tensor, estimate: torch.Tensor, offset: torch.Tensor | None, low: int, high: int):
    """(d float16 (n,), codes (n, 32)) of every block, or None when one has no d near `estimate`."""
    d_found = torch.zeros(values.shape[0], dtype=torch.float16)
    codes_found = torch.zeros_like(values)
    pending = torch.ones(values.shape[0], dtype=torch.bool)
    bits = estimate.view(torch.int16)
    for step in D_STEPS:
        index = pending.nonzero().squeeze(1)
        if index.numel() == 0:
            break
        d = (bits[index] + step).view(torch.float16)
        if not torch.isfinite(d).all() or (d < 0).any():
            continue
        codes, ok = _codes(values[index], d.float()[:, None], None if offset is None else offset[index][:, None],
                           low, high)
        d_found[index[ok]], codes_found[index[ok]] = d[ok], codes[ok]
        pending[index[ok]] = False
    return None if pending.any() else (d_found, codes_found)


def _q4_1(values: torch.Tensor) -> torch.Tensor | None:
    """block_q4_1 bytes (n, 20) of float32 blocks (n, 32), or None."""
    low, high = values.amin(dim=1), values.amax(dim=1)
    m = low.half()  # the smallest value is float(m) + d * 0
    if not (torch.isfinite(low).all() and _same_bits(m.float(), low).all()):
        return None
    found = _find(values, ((high - low) / 15).half(), low, 0, 15)
    if found is None:
        return None
    d, codes = found
    codes = codes.to(torch.uint8)
    nibbles = codes[:, :16] | (codes[:, 16:] << 4)
    return torch.cat([d.view(torch.uint8).reshape(-1, 2), m.view(torch.uint8).reshape(-1, 2), nibbles], dim=1)


def _q8_0(values: torch.Tensor) -> torch.Tensor | None:
    """block_q8_0 bytes (n, 34) of float32 blocks (n, 32), or None."""
    if not torch.isfinite(values).all():
        return None
    found = _find(values, (values.abs().amax(dim=1) / 127).half(), None, -128, 127)
    if found is None:
        return None
    d, codes = found
    return torch.cat([d.view(torch.uint8).reshape(-1, 2), codes.to(torch.int8).view(torch.uint8)], dim=1)
