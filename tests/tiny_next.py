"""Tiny random-weight targets whose drafters read the target, saved like real checkpoints.

Families (the configs that build with transformers 5.24, vocabulary about 430):
- qwen3_5:       Qwen3.5, text layers [linear_attention, full_attention] (a recurrent state to
                 roll back), M-RoPE with mrope_section [2, 1, 1] interleaved, partial rotary 0.25.

Each builder writes a folder that `models.loading.load_target` reads; tokenizers and processors
come from tests/tiny.py (a byte-level BPE trained in-process, image-only processors).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText, Qwen3_5Config

from tests import tiny

FAMILIES: tuple[str, ...] = ("qwen3_5",)

_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048)


def build_target(family: str, out_dir: Path, seed: int = 0) -> Path:
    builders = {"qwen3_5": _qwen3_5}
    if family not in builders:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    return builders[family](Path(out_dir), seed)


def _qwen3_5(out_dir: Path, seed: int) -> Path:
    tokenizer = tiny._tokenizer(tiny._QWEN_TOKENS)
    processor = tiny._processor("qwen3_vl", tokenizer)  # patch 16, merge 2: Qwen3.5's vision sizes
    ids = tokenizer.convert_tokens_to_ids
    # init std 0.1: with 0.2 the answer ignores the images (greedy output equal for 0, 1, 2 images)
    text = dict(
        _TEXT, initializer_range=0.1, head_dim=32, vocab_size=len(tokenizer), layer_types=["linear_attention", "full_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64,
                  initializer_range=tiny.INIT_STD)
    config = Qwen3_5Config(
        text_config=text, vision_config=vision, initializer_range=0.1, image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    # Slow decay (A in [0.01, 0.1] instead of up to 16): the recurrent state then remembers the
    # tokens of a rejected draft, so a rollback that does not rewind it changes the answer.
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(0.01, 0.1).log_()
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir
