"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL: M-RoPE with a per-request rope_delta (see base.MRopeFamily)."""

from .base import MRopeFamily

QWEN2_VL = MRopeFamily("qwen2_vl", ("qwen2_vl",))
QWEN2_5_VL = MRopeFamily("qwen2_5_vl", ("qwen2_5_vl",))
QWEN3_VL = MRopeFamily("qwen3_vl", ("qwen3_vl",))
FAMILIES = (QWEN2_VL, QWEN2_5_VL, QWEN3_VL)
