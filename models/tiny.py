"""Tiny random-weight vision-language models for CPU tests and the GPU check's short mode, saved like
real checkpoints.

Every builder writes a folder that loads through the ordinary paths:
`AutoModelForImageTextToText.from_pretrained(folder)` with `models.processors.load_processor(folder)`
or, for a text drafter, `AutoModelForCausalLM` with `AutoTokenizer`. Nothing is downloaded: the
tokenizer is a byte-level BPE trained here on `_CORPUS`, with the family's special tokens and a
chat template in the family's style (multi-turn, optional system message, `{"type": "image"}`
and `{"type": "text"}` content parts).

Sizes: text hidden 64, 2 layers, 4 heads (2 kv heads), head_dim 16; vision hidden 32, 1-2 layers;
about 150-250k parameters. Image-feature tokens for one `tiny_images` image (plus marker tokens):
Qwen2-VL / Qwen2.5-VL 4-9 (+2), Qwen3-VL 4-6 (+2), Idefics3 / SmolVLM 20 = 2x2 tiles and a global
view of 4 each (+11), LLaVA 16, Gemma 3 16 (+2). Gemma 3 has a 16-token sliding window on its first
layer (the second is full attention), so any prompt with an image exceeds it.

Same family and seed give the same weights and the same tokenizer ids.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    CLIPImageProcessorPil,
    Gemma3Config,
    Gemma3ImageProcessorPil,
    Gemma3Processor,
    Idefics3Config,
    Idefics3ImageProcessorPil,
    Idefics3Processor,
    LlavaConfig,
    LlavaProcessor,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLProcessor,
    Qwen2VLConfig,
    Qwen2VLImageProcessorPil,
    Qwen2VLProcessor,
    Qwen3VLConfig,
    Qwen3VLProcessor,
    SmolVLMConfig,
    SmolVLMImageProcessorPil,
    SmolVLMProcessor,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.processing_utils import ProcessorMixin

from models.processors import build_image_only_processor

FAMILIES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "idefics3", "smolvlm", "llava", "gemma3")

# Standard deviation of the random init. With the library default (0.02) greedy output soon
# repeats one token; 0.2 gives varied greedy text for every family here, target and drafter.
# (Gemma 3 repeats its input token whatever the std while its embeddings are tied, so the tiny
# Gemma 3 unties them.)
INIT_STD = 0.2

# Text towers: the target, and a smaller one for `build_vlm_drafter`. head_dim is 16 in both.
_TARGET_TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
_DRAFT_TEXT = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
)
_HEAD_DIM = 16
_MAX_POSITIONS = 2048
_GEMMA3_SLIDING_WINDOW = 16

# M-RoPE splits head_dim // 2 = 8 rotary frequencies over (time, height, width).
_QWEN_PATCH_SIZE = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16}
_QWEN_PROCESSORS = {
    "qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor
}
_QWEN2_MROPE_SECTION = [2, 3, 3]
_QWEN3_MROPE_SECTION = [4, 2, 2]  # interleaved: height and width take every third frequency

_VOCAB_SIZE = 384  # ordinary BPE tokens; the family's special tokens come on top

_CORPUS = """\
The small robot walked along the river and counted the stones on the bank. Each stone had a colour:
red, green, blue, yellow, black or white. When the sun was high, the water was bright and the robot
stopped to look at the birds. A picture can show a cat on a chair, a dog in the garden, a red car on
the road, or a tree beside a house. Describe the image in one sentence. What is in the picture?
There are two apples and three oranges on the table. The man is reading a book near the window.
The sky is blue and the grass is green. She wrote a short letter to her friend about the trip to the
mountains, the long train, the cold lake and the quiet village where they stayed for a week.
Question: how many people are in the photo? Answer: there are four people standing in a line.
The first image shows a city street at night; the second image shows the same street in the morning.
Numbers: one, two, three, four, five, six, seven, eight, nine, ten, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10.
You are a helpful assistant. Please answer the question about the images as briefly as you can.
The weather today is warm with a light wind from the west, and it may rain in the evening.
"""


@dataclass(frozen=True)
class _Tokens:
    """A family's special tokens: the named ones go to `extra_special_tokens`."""

    eos: str
    pad: str
    bos: str | None = None
    named: dict[str, str] = field(default_factory=dict)
    other: tuple[str, ...] = ()

    def all(self) -> list[str]:
        tokens = [self.bos, self.eos, self.pad, *self.named.values(), *self.other]
        return list(dict.fromkeys(token for token in tokens if token is not None))


_QWEN_TOKENS = _Tokens(
    eos="<|im_end|>",
    pad="<|endoftext|>",
    named={
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "vision_start_token": "<|vision_start|>",
        "vision_end_token": "<|vision_end|>",
    },
    other=("<|im_start|>",),
)
_ROW_COL_TOKENS = tuple(f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7))
_IDEFICS3_NAMED = {
    "image_token": "<image>",
    "fake_image_token": "<fake_token_around_image>",
    "global_image_token": "<global-img>",
    "end_of_utterance_token": "<end_of_utterance>",
}
_TOKENS = {
    "qwen2_vl": _QWEN_TOKENS,
    "qwen2_5_vl": _QWEN_TOKENS,
    "qwen3_vl": _QWEN_TOKENS,
    "idefics3": _Tokens(
        bos="<|begin_of_text|>", eos="<end_of_utterance>", pad="<|end_of_text|>",
        named=_IDEFICS3_NAMED, other=_ROW_COL_TOKENS,
    ),
    "smolvlm": _Tokens(
        bos="<|im_start|>", eos="<end_of_utterance>", pad="<|im_end|>",
        named=_IDEFICS3_NAMED, other=_ROW_COL_TOKENS,
    ),
    "llava": _Tokens(bos="<s>", eos="</s>", pad="<pad>", named={"image_token": "<image>"}),
    "gemma3": _Tokens(
        bos="<bos>", eos="<end_of_turn>", pad="<pad>",
        named={
            "image_token": "<image_soft_token>",
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
        },
        other=("<start_of_turn>",),
    ),
}


def _chat_template(image: str, body: str) -> str:
    """A template whose `render(content)` macro prints text parts and `image` for image parts.

    Jinja runs with trim_blocks here: a newline right after a block tag is dropped, so
    templates write newlines after tags as {{ '\\n' }}.
    """
    render = (
        "{% macro render(content) %}{% if content is string %}{{ content }}{% else %}"
        "{% for part in content %}{% if part['type'] == 'image' %}" + image
        + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
        "{% endif %}{% endmacro %}"
    )
    return render + body


_QWEN_TEMPLATE = _chat_template(
    "<|vision_start|><|image_pad|><|vision_end|>",
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ render(message['content']) }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
)
_IDEFICS3_BODY = (
    "{% for message in messages %}{{ message['role'] | capitalize }}:{{ render(message['content']) }}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
_TEMPLATES = {
    "qwen2_vl": _QWEN_TEMPLATE,
    "qwen2_5_vl": _QWEN_TEMPLATE,
    "qwen3_vl": _QWEN_TEMPLATE,
    "idefics3": _chat_template("<image>", "<|begin_of_text|>" + _IDEFICS3_BODY),
    "smolvlm": _chat_template("<image>", "<|im_start|>" + _IDEFICS3_BODY),
    "llava": _chat_template(
        "<image>\n",
        "{% for message in messages %}{{ message['role'] | upper }}: {{ render(message['content']) }}"
        "{% if message['role'] == 'assistant' %}</s>{% endif %} {% endfor %}"
        "{% if add_generation_prompt %}ASSISTANT:{% endif %}",
    ),
    # Gemma 3 folds the system message into the first user turn and calls the assistant "model".
    "gemma3": _chat_template(
        "<start_of_image>",
        "<bos>{% set ns = namespace(system='') %}{% if messages[0]['role'] == 'system' %}"
        "{% set ns.system = render(messages[0]['content']) ~ '\\n\\n' %}{% set messages = messages[1:] %}"
        "{% endif %}{% for message in messages %}<start_of_turn>"
        "{{ 'model' if message['role'] == 'assistant' else message['role'] }}{{ '\\n' }}"
        "{% if loop.first %}{{ ns.system }}{% endif %}{{ render(message['content']) }}"
        "<end_of_turn>{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model{{ '\\n' }}{% endif %}",
    ),
}


# Entry points


def build_target(family: str, out_dir: Path, seed: int = 0, num_hidden_layers: int | None = None) -> Path:
    """A tiny random VLM of `family` with its processor, saved in `out_dir` (`num_hidden_layers`:
    a deeper text model than the default 2, for drafters that read several target layers)."""
    text = _TARGET_TEXT if num_hidden_layers is None else dict(_TARGET_TEXT, num_hidden_layers=num_hidden_layers)
    return _build_vlm(family, Path(out_dir), seed, text)


def build_vlm_drafter(family: str, out_dir: Path, seed: int = 1) -> Path:
    """A smaller random VLM of `family` sharing the target's tokenizer and processor."""
    return _build_vlm(family, Path(out_dir), seed, _DRAFT_TEXT)


def build_text_drafter(target_dir: Path, out_dir: Path) -> Path:
    """A text-only causal LM holding a copy of the target's language model and lm_head.

    On a text-only prompt it predicts exactly what the target predicts (float32). Saved with
    the target's tokenizer and chat template.
    """
    out_dir = Path(out_dir)
    target = AutoModelForImageTextToText.from_pretrained(target_dir, dtype=torch.float32)
    drafter = AutoModelForCausalLM.from_config(_causal_lm_config(target.config), dtype=torch.float32)
    drafter.get_decoder().load_state_dict(target.get_decoder().state_dict())
    drafter.get_output_embeddings().load_state_dict(target.get_output_embeddings().state_dict())
    drafter.generation_config = target.generation_config
    drafter.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(target_dir).save_pretrained(out_dir)
    return out_dir


def tiny_images(n: int, seed: int = 0) -> list[Image.Image]:
    """`n` small deterministic RGB images (gradients plus noise), 56 to 96 pixels a side."""
    sizes = [(64, 64), (96, 64), (56, 80), (80, 80)]  # (width, height)
    rng = np.random.default_rng(seed)
    images = []
    for i in range(n):
        width, height = sizes[(seed + i) % len(sizes)]
        y, x = np.mgrid[0:height, 0:width]
        base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], axis=-1)
        noise = rng.integers(0, 64, size=(height, width, 3))
        images.append(Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB"))
    return images


def build_all(root: Path) -> dict[str, Path]:
    """A target for every family, in root/<family>."""
    return {family: build_target(family, Path(root) / family) for family in FAMILIES}


# Building blocks


def _build_vlm(family: str, out_dir: Path, seed: int, text: dict) -> Path:
    if family not in _TOKENS:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    tokenizer = _tokenizer(_TOKENS[family])
    processor = _processor(family, tokenizer)
    config = _config(family, tokenizer, text)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


def _tokenizer(tokens: _Tokens) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `_CORPUS`; the special tokens get the ids after the ordinary ones."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator(_CORPUS.splitlines(), trainer)
    bpe.add_special_tokens(tokens.all())
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=tokens.bos,
        eos_token=tokens.eos,
        pad_token=tokens.pad,
        extra_special_tokens=tokens.named,
    )


def _processor(family: str, tokenizer: PreTrainedTokenizerFast) -> ProcessorMixin:
    template = _TEMPLATES[family]
    if family in _QWEN_PROCESSORS:
        patch_size = _QWEN_PATCH_SIZE[family]
        factor = 2 * patch_size  # one merged image token covers factor x factor pixels
        image_processor = Qwen2VLImageProcessorPil(
            patch_size=patch_size,
            merge_size=2,
            temporal_patch_size=2,
            size={"shortest_edge": (2 * factor) ** 2, "longest_edge": (3 * factor) ** 2},  # 2x2 to 3x3 tokens
        )
        return build_image_only_processor(
            _QWEN_PROCESSORS[family], image_processor, tokenizer, chat_template=template
        )
    if family in ("idefics3", "smolvlm"):
        # Resized to a longest edge of 64, then split into 32-pixel tiles plus a global view;
        # each tile gives (32 / 8)**2 / 2**2 = 4 image tokens.
        image_options = dict(
            size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True
        )
        if family == "idefics3":
            image_processor = Idefics3ImageProcessorPil(**image_options)
            return Idefics3Processor(image_processor, tokenizer, image_seq_len=4, chat_template=template)
        image_processor = SmolVLMImageProcessorPil(**image_options)
        return build_image_only_processor(
            SmolVLMProcessor, image_processor, tokenizer, image_seq_len=4, chat_template=template
        )
    if family == "llava":
        image_processor = CLIPImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        )
        return LlavaProcessor(
            image_processor,
            tokenizer,
            patch_size=8,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,  # CLIP's class token, dropped by the "default" strategy
            chat_template=template,
        )
    image_processor = Gemma3ImageProcessorPil(size={"height": 64, "width": 64}, do_pan_and_scan=False)
    return Gemma3Processor(image_processor, tokenizer, chat_template=template, image_seq_length=16)


def _config(family: str, tokenizer: PreTrainedTokenizerFast, text: dict) -> PretrainedConfig:
    """The family's model config; token ids are read from `tokenizer`."""
    text_config = dict(
        text,
        vocab_size=len(tokenizer),
        max_position_embeddings=_MAX_POSITIONS,
        initializer_range=INIT_STD,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return _CONFIG_BUILDERS[family](family, tokenizer.convert_tokens_to_ids, text_config)


_SMALL_VISION = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, initializer_range=INIT_STD)


def _qwen_config(family: str, ids, text_config: dict) -> PretrainedConfig:
    hidden = text_config["hidden_size"]
    token_ids = dict(
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": _QWEN2_MROPE_SECTION}
    patch = dict(patch_size=_QWEN_PATCH_SIZE[family], spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen2_vl":
        config_class = Qwen2VLConfig
        vision = dict(
            patch, depth=1, embed_dim=32, hidden_size=hidden, mlp_ratio=2, num_heads=2,
            initializer_range=INIT_STD,
        )
    elif family == "qwen2_5_vl":
        config_class = Qwen2_5_VLConfig
        vision = dict(
            _SMALL_VISION, **patch, depth=2, num_heads=2, out_hidden_size=hidden,
            window_size=56, fullatt_block_indexes=[1],
        )
    else:
        config_class = Qwen3VLConfig
        rope = dict(rope, mrope_section=_QWEN3_MROPE_SECTION, mrope_interleaved=True)
        text_config = dict(text_config, head_dim=_HEAD_DIM)
        vision = dict(
            _SMALL_VISION, **patch, depth=2, num_heads=2, out_hidden_size=hidden,
            num_position_embeddings=64, deepstack_visual_indexes=[0],
        )
    return config_class(
        text_config=dict(text_config, rope_parameters=rope),
        vision_config=vision,
        initializer_range=INIT_STD,
        **token_ids,
    )


def _idefics3_config(family: str, ids, text_config: dict) -> PretrainedConfig:
    config_class = Idefics3Config if family == "idefics3" else SmolVLMConfig
    return config_class(
        text_config=dict(text_config, model_type="llama", head_dim=_HEAD_DIM),
        vision_config=dict(_SMALL_VISION, num_hidden_layers=1, image_size=32, patch_size=8),
        scale_factor=2,
        image_token_id=ids("<image>"),
        initializer_range=INIT_STD,
    )


def _llava_config(family: str, ids, text_config: dict) -> PretrainedConfig:
    vision = dict(
        _SMALL_VISION, model_type="clip_vision_model", num_hidden_layers=2, image_size=32, patch_size=8,
        projection_dim=32,
    )
    return LlavaConfig(
        text_config=dict(text_config, model_type="llama", head_dim=_HEAD_DIM),
        vision_config=vision,
        image_token_index=ids("<image>"),
        image_seq_length=16,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        initializer_range=INIT_STD,
    )


def _gemma3_config(family: str, ids, text_config: dict) -> PretrainedConfig:
    layer_types = ["sliding_attention", "full_attention"][: text_config["num_hidden_layers"]]
    text_config = dict(
        text_config,
        head_dim=_HEAD_DIM,
        query_pre_attn_scalar=_HEAD_DIM,
        sliding_window=_GEMMA3_SLIDING_WINDOW,
        layer_types=layer_types,
    )
    # 64 / 8 = 8x8 patches, average-pooled to 4x4 = 16 image tokens.
    vision = dict(
        _SMALL_VISION, model_type="siglip_vision_model", num_hidden_layers=1, image_size=64, patch_size=8
    )
    return Gemma3Config(
        text_config=text_config,
        vision_config=vision,
        mm_tokens_per_image=16,
        boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"),
        initializer_range=INIT_STD,
        tie_word_embeddings=False,  # tied, the tiny model keeps repeating its input token
    )


_CONFIG_BUILDERS = {
    "qwen2_vl": _qwen_config,
    "qwen2_5_vl": _qwen_config,
    "qwen3_vl": _qwen_config,
    "idefics3": _idefics3_config,
    "smolvlm": _idefics3_config,
    "llava": _llava_config,
    "gemma3": _gemma3_config,
}

# Text config model type of each VLM -> the causal LM that has the same layers.
_CAUSAL_LM_TYPE = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3"}


def _causal_lm_config(vlm_config: PretrainedConfig) -> PretrainedConfig:
    """Config of a text-only causal LM with the VLM's language model (M-RoPE becomes 1-D RoPE)."""
    text_config = vlm_config.get_text_config()
    tie = getattr(vlm_config, "tie_word_embeddings", False)
    model_type = _CAUSAL_LM_TYPE.get(text_config.model_type)
    if model_type is None:  # llama, gemma3_text: the text config is already a causal LM's
        config = text_config.__class__.from_dict(text_config.to_dict())
        config.tie_word_embeddings = tie
        return config
    config_class = CONFIG_MAPPING[model_type]
    accepted = inspect.signature(config_class.__init__).parameters
    fields = {key: value for key, value in text_config.to_dict().items() if key in accepted}
    # With text only, the three M-RoPE rows are equal, which is plain RoPE.
    rope_theta = text_config.rope_parameters["rope_theta"]
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta}
    fields["tie_word_embeddings"] = tie
    return config_class(**fields)
