"""Real model architectures with random weights, built offline from their published configs and
cached on disk, for measuring speed at real sizes (measure/realscale.py, measure/gpu_check.py).

The shapes below are the `config.json` values that Hugging Face publishes with each checkpoint
(huggingface.co/<id>/blob/main/config.json; ids in SHAPES). Only the shape matters here: the
weights are random (normal, std 0.02) and the tokenizer is the tests' small byte-level BPE
(models/tiny.py) with the family's special tokens, so prompts are longer in tokens than the real
tokenizer's but the embedding and output layers have the real vocabulary size. Image processors
use the published patch and merge sizes.

`quick=True` shrinks every shape (2 layers, hidden 64; vocabularies kept) for CI and smoke runs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

CACHE = Path(os.environ.get("VLM_SPEC_BENCH_CACHE", Path.home() / ".cache" / "vlm-spec-bench"))

# Qwen/Qwen2.5-VL-3B-Instruct
QWEN25_VL_3B = dict(
    family="qwen2_5_vl", hub_id="Qwen/Qwen2.5-VL-3B-Instruct",
    text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
              num_key_value_heads=2, vocab_size=151936, max_position_embeddings=128000, rms_norm_eps=1e-6,
              rope_theta=1000000.0, tie_word_embeddings=True, mrope_section=[16, 24, 24]),
    vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu"),
)
# Qwen/Qwen2.5-VL-7B-Instruct
QWEN25_VL_7B = dict(
    family="qwen2_5_vl", hub_id="Qwen/Qwen2.5-VL-7B-Instruct",
    text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
              num_key_value_heads=4, vocab_size=152064, max_position_embeddings=128000, rms_norm_eps=1e-6,
              rope_theta=1000000.0, tie_word_embeddings=False, mrope_section=[16, 24, 24]),
    vision=dict(QWEN25_VL_3B["vision"], out_hidden_size=3584),
)
# Qwen/Qwen2.5-0.5B-Instruct (the text drafter of both Qwen2.5-VL presets)
QWEN25_05B = dict(
    model_type="qwen2", hub_id="Qwen/Qwen2.5-0.5B-Instruct",
    text=dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
              rope_theta=1000000.0, tie_word_embeddings=True),
)
# HuggingFaceTB/SmolVLM-256M-Instruct (an Idefics3 model)
SMOLVLM_256M = dict(
    family="idefics3", hub_id="HuggingFaceTB/SmolVLM-256M-Instruct",
    text=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
              num_key_value_heads=3, vocab_size=49280, max_position_embeddings=8192, rms_norm_eps=1e-5,
              rope_theta=100000.0, tie_word_embeddings=False),
    vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                image_size=512, patch_size=16),
    scale_factor=4,
)
# HuggingFaceTB/SmolLM2-135M-Instruct (SmolVLM-256M's text drafter)
SMOLLM2_135M = dict(
    model_type="llama", hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    text=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
              num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
              rope_theta=100000.0, tie_word_embeddings=True),
)

SHAPES = {"qwen2.5-vl-3b": QWEN25_VL_3B, "qwen2.5-vl-7b": QWEN25_VL_7B, "qwen2.5-0.5b": QWEN25_05B,
          "smolvlm-256m": SMOLVLM_256M, "smollm2-135m": SMOLLM2_135M}
# preset -> (target shape, text drafter shape), as in models/presets.py
PRESETS = {"qwen2.5-vl-3b": ("qwen2.5-vl-3b", "qwen2.5-0.5b"), "smolvlm-256m": ("smolvlm-256m", "smollm2-135m"),
           "qwen2.5-vl-7b": ("qwen2.5-vl-7b", "qwen2.5-0.5b")}
QUICK_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)


def build_preset(preset: str, quick: bool = False, cache: Path | None = None) -> tuple[Path, Path]:
    """(target folder, text drafter folder) of a preset, built on first use (under CACHE)."""
    target_shape, drafter_shape = PRESETS[preset]
    cache = cache or CACHE
    target = build(target_shape, quick, cache)
    return target, build(drafter_shape, quick, cache, tokenizer_from=target)


def build(name: str, quick: bool, cache: Path, tokenizer_from: Path | None = None) -> Path:
    """The folder of shape `name` (random weights, bfloat16 on disk); built once, then reused."""
    folder = Path(cache) / (name + ("-quick" if quick else ""))
    if (folder / "model.safetensors").exists() or (folder / "model.safetensors.index.json").exists():
        return folder
    from models import tiny  # the offline tokenizer, processors and chat templates of the tests

    shape = SHAPES[name]
    print(f"building {folder} (random weights, once)", file=sys.stderr)
    text = dict(shape["text"], **(QUICK_TEXT if quick else {}))
    torch.manual_seed(0)
    if "family" in shape:
        from transformers import AutoModelForImageTextToText

        family = shape["family"]
        tokenizer = tiny._tokenizer(tiny._TOKENS[family])
        processor = _processor(family, tokenizer, shape)
        config = _vlm_config(shape, text, tokenizer, quick)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(folder)
        processor.save_pretrained(folder)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_config(_text_config(shape["model_type"], text), dtype=torch.bfloat16)
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(folder)
    return folder


def _text_config(model_type: str, text: dict):
    from transformers import CONFIG_MAPPING

    fields = {k: v for k, v in text.items() if k not in ("rope_theta", "mrope_section")}
    return CONFIG_MAPPING[model_type](**fields, initializer_range=0.02,
                                      rope_parameters={"rope_type": "default", "rope_theta": text["rope_theta"]})


def _vlm_config(shape: dict, text: dict, tokenizer, quick: bool):
    from transformers import Idefics3Config, Qwen2_5_VLConfig

    ids = tokenizer.convert_tokens_to_ids
    fields = {k: v for k, v in text.items() if k not in ("rope_theta", "mrope_section", "tie_word_embeddings")}
    fields.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, initializer_range=0.02)
    vision = dict(shape["vision"], initializer_range=0.02)
    if shape["family"] == "qwen2_5_vl":
        head_dim = text["hidden_size"] // text["num_attention_heads"]
        section = text["mrope_section"] if not quick else [2, 3, 3]  # sum = head_dim / 2
        assert sum(section) == head_dim // 2
        if quick:
            vision.update(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, fullatt_block_indexes=[1])
        vision["out_hidden_size"] = text["hidden_size"]
        rope = {"rope_type": "default", "rope_theta": text["rope_theta"], "mrope_section": section}
        return Qwen2_5_VLConfig(text_config=dict(fields, rope_parameters=rope), vision_config=vision,
                                image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                                vision_start_token_id=ids("<|vision_start|>"),
                                vision_end_token_id=ids("<|vision_end|>"),
                                tie_word_embeddings=text["tie_word_embeddings"], initializer_range=0.02)
    if quick:
        vision.update(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    rope = {"rope_type": "default", "rope_theta": text["rope_theta"]}
    return Idefics3Config(text_config=dict(fields, model_type="llama", rope_parameters=rope), vision_config=vision,
                          scale_factor=shape["scale_factor"], image_token_id=ids("<image>"),
                          tie_word_embeddings=text["tie_word_embeddings"], initializer_range=0.02)


def _processor(family: str, tokenizer, shape: dict):
    """The family's processor at the published patch and merge sizes."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor, Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

    from models.processors import build_image_only_processor
    from models import tiny

    if family == "qwen2_5_vl":  # Qwen2.5-VL's published min / max pixels
        image_processor = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2,
                                                   size={"shortest_edge": 3136, "longest_edge": 12845056})
        return build_image_only_processor(Qwen2_5_VLProcessor, image_processor, tokenizer,
                                          chat_template=tiny._TEMPLATES[family])
    # one 512-pixel view of (512 / 16)^2 / 4^2 = 64 tokens (the published processor also splits
    # larger images into 512-pixel tiles of 64 tokens each)
    vision = shape["vision"]
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": vision["image_size"]},
                                                max_image_size={"longest_edge": vision["image_size"]},
                                                do_image_splitting=False)
    seq_len = (vision["image_size"] // vision["patch_size"]) ** 2 // shape["scale_factor"] ** 2
    return Idefics3Processor(image_processor, tokenizer, image_seq_len=seq_len, chat_template=tiny._TEMPLATES[family])
