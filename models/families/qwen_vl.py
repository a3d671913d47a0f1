"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL: M-RoPE with a per-request rope_delta (see base.MRopeFamily)."""

from .base import MRopeFamily

QWEN2_VL = MRopeFamily("qwen2_vl", ("qwen2_vl",), direct_text_steps=True)
QWEN2_5_VL = MRopeFamily("qwen2_5_vl", ("qwen2_5_vl",), direct_text_steps=True)
QWEN3_VL = MRopeFamily("qwen3_vl", ("qwen3_vl",), direct_text_steps=True)
FAMILIES = (QWEN2_VL, QWEN2_5_VL, QWEN3_VL)
