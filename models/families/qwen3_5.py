"""Qwen3.5: M-RoPE like Qwen3-VL (three rows, a per-request rope_delta) and Qwen-VL's image
patchifier (qwen_vl.QwenVLFamily), and a hybrid text model: linear-attention (recurrent) layers
between the full-attention ones. The Runner for it is engine.linear_attention_rollback.HybridRunner, whose rollback
rewinds the recurrent state."""

from .qwen_vl import QwenVLFamily

QWEN3_5 = QwenVLFamily("qwen3_5", ("qwen3_5",))
FAMILIES = (QWEN3_5,)
