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
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from engine import huge_pages
from engine.schema import switches

BLOCK = 32
FORMATS = {"q4_1": 20, "q8_0": 34}  # bytes a block, ggml's block_q4_1 and block_q8_0
D_STEPS = (0, 1, -1, 2, -2)  # float16 neighbours of the estimated d tried, in this order


@dataclass
class PackedWeight:
    """A float32 weight (in, out) and the same values as ggml blocks (out, in / 32, bytes)."""

    weight: torch.Tensor  # (in, out) float32, as fast_decode.linear takes it (the model's own values)
    blocks: torch.Tensor  # (out, in / 32, FORMATS[format]) uint8
    format: str  # "q4_1" or "q8_0"

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


def place(weights: list[PackedWeight]) -> None:
    """Move the weights' blocks onto 2 MB pages (engine/huge_pages.py), in one buffer."""
    arena = huge_pages.arena_for([w.blocks for w in weights])
    for weight in weights:
        weight.blocks = arena.place(weight.blocks) if arena is not None else weight.blocks


def unpack(blocks: torch.Tensor, format: str) -> torch.Tensor:
    """The float32 values (out, in) of ggml blocks (out, in / 32, bytes), as gguf-py computes them."""
    out, count, _ = blocks.shape
    flat = blocks.reshape(-1, FORMATS[format])
    d = flat[:, :2].contiguous().view(torch.float16).float()
    if format == "q4_1":
        m = flat[:, 2:4].contiguous().view(torch.float16).float()
        codes = flat[:, 4:]
        q = torch.cat([codes & 15, codes >> 4], dim=1).float()
        values = d * q + m
    else:
        values = d * flat[:, 2:].contiguous().view(torch.int8).float()
    return values.reshape(out, count * BLOCK)


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
