"""Tiny random-weight targets whose drafters read the target, saved like real checkpoints.

Families (the configs that build with transformers 5.24, vocabulary about 430):
- qwen3_5:       Qwen3.5, text layers [linear_attention, full_attention] (a recurrent state to
                 roll back), M-RoPE with mrope_section [2, 1, 1] interleaved, partial rotary 0.25;
                 one MTP layer in the saved checkpoint, as hub checkpoints carry it (`mtp.*`,
                 `mtp_num_hidden_layers: 1`), which `--drafter mtp` drafts with.
- step3p7:       Step-3.7 with `num_nextn_predict_layers` MTP layers written into the saved
                 checkpoint (as hub checkpoints carry them: `model.layers.<N + k>.*`), 1-D RoPE;
                 one image = a 224-pixel global view of 16 <im_patch> tokens between <im_start>
                 and <im_end>, plus 112-pixel local crops of 4 tokens each when the image is
                 larger than 224 pixels or elongated (images over 448 pixels are scaled down).
- muse_glimmer:  MuseGlimmer, 4 text layers (3 sliding with a 16-token window, 1 full NoPE), 1-D
                 RoPE; one image = at most 16 <|patch|> tokens; `build_dflash_assistant` writes
                 its DFlash assistant (hidden 64, 1 layer, block_size 4, target_layer_ids [0, 2]).
- gemma4:        Gemma 4, text layers [sliding (16-token window), full], per-layer inputs of size 8,
                 init std 0.05; one image = 70 soft tokens; `build_shared_cache_assistant` writes
                 its `gemma4_assistant` (hidden 32, 2 layers sharing all K/V with the target).

Each builder writes a folder like a real checkpoint, processor files included (processor_config.json,
tokenizer, chat template), so that it loads through `models.processors.load_processor`; `load(folder)`
loads it as the engine's target. Tokenizers and chat templates come from models/tiny.py (a byte-level
BPE trained in-process). The image processors are the production PIL ones (models/families/step3p7.py, muse_glimmer.py
for Step-3.7 and MuseGlimmer, transformers' own for Gemma 4), and MuseGlimmer's and Gemma 4's
processors are image-only (`build_image_only_processor`).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForImageTextToText,
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4Config,
    Gemma4Processor,
    MuseGlimmerAssistantConfig,
    MuseGlimmerAssistantModel,
    MuseGlimmerConfig,
    MuseGlimmerProcessor,
    Qwen3_5Config,
    Step3p7Config,
    Step3p7Processor,
)
from transformers.modeling_layers import MtpModel
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer
from transformers.processing_utils import ProcessorMixin

from engine.engine import Engine
from engine.loop import DecodeSettings, Done
from engine.target import load_target
from models import loading
from models.families.muse_glimmer import MuseGlimmerImageProcessorPil
from models.families.step3p7 import Step3p7ImageProcessorPil
from models.processors import build_image_only_processor
from models import tiny

FAMILIES: tuple[str, ...] = ("qwen3_5", "step3p7", "muse_glimmer", "gemma4")
STEP3P7_MTP_LAYERS = 3

_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048)


def build_target(family: str, out_dir: Path, seed: int = 0) -> Path:
    builders = {"qwen3_5": _qwen3_5, "step3p7": _step3p7, "muse_glimmer": _muse_glimmer, "gemma4": _gemma4}
    if family not in builders:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    return builders[family](Path(out_dir), seed)


def load(folder: Path):
    """The engine's Target for a folder written by `build_target` (float32, CPU)."""
    return load_target(str(folder), loading.LoadOptions(dtype="float32", device="cpu"))


def _processor(processor_class, image_processor, tokens: tiny._Tokens, image_part: str, **options) -> ProcessorMixin:
    """An image-only `processor_class` with a tiny tokenizer and the Qwen-style chat template,
    images written as `image_part`."""
    template = tiny._QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", image_part)
    return build_image_only_processor(processor_class, image_processor, tiny._tokenizer(tokens),
                                      chat_template=template, **options)


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
        mtp_num_hidden_layers=1,  # as published checkpoints say; transformers builds no module for it
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
    _write_qwen3_5_mtp_layer(model.config.get_text_config(), out_dir / "model.safetensors")
    return out_dir


def _write_qwen3_5_mtp_layer(text_config, checkpoint: Path, seed: int = 3) -> None:
    """A random MTP layer appended to a saved checkpoint under the published top-level names:
    `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*` (a
    full-attention decoder layer), `mtp.norm`."""
    layer_config = copy.deepcopy(text_config)
    layer_config.layer_types = ["full_attention"]
    torch.manual_seed(seed)
    layer = Qwen3_5DecoderLayer(layer_config, 0)
    hidden = text_config.hidden_size
    tensors = load_file(checkpoint)
    tensors |= {f"mtp.layers.0.{name}": (weight + 0.2 * torch.randn_like(weight)).contiguous()
                for name, weight in layer.state_dict().items()}
    tensors |= {"mtp.fc.weight": torch.randn(hidden, 2 * hidden) * 0.1}
    tensors |= {f"mtp.{name}.weight": torch.randn(hidden) * 0.1
                for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    save_file(tensors, checkpoint, metadata={"format": "pt"})


_STEP3P7_TOKENS = tiny._Tokens(
    bos="<|begin|>", eos="<|im_end|>", pad="<|pad|>", named={"image_token": "<im_patch>"},
    other=("<|im_start|>", "<im_start>", "<im_end>", "<patch_start>", "<patch_end>", "<patch_newline>"),
)


def _step3p7_processor() -> Step3p7Processor:
    # 14-pixel ViT patches, downsampled 4 x: a 224-pixel view is 4 x 4 tokens, a 112-pixel crop 2 x 2
    image_processor = Step3p7ImageProcessorPil(size={"height": 224, "width": 224}, patch_size=112, max_image_size=448)
    return _processor(Step3p7Processor, image_processor, _STEP3P7_TOKENS, "<im_patch>")


def _step3p7(out_dir: Path, seed: int) -> Path:
    processor = _step3p7_processor()
    tokenizer = processor.tokenizer
    num_layers, num_mtp = _TEXT["num_hidden_layers"], STEP3P7_MTP_LAYERS
    text = dict(
        _TEXT, initializer_range=tiny.INIT_STD, head_dim=16, vocab_size=len(tokenizer),
        sliding_window=512,  # required by the config even with full attention only
        num_nextn_predict_layers=num_mtp, mlp_layer_types=["dense"] * (num_layers + num_mtp),
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=224,
                  patch_size=14, max_position_embeddings=256, initializer_range=tiny.INIT_STD,
                  rope_parameters={"rope_type": "axial", "rope_theta": 1e4})
    config = Step3p7Config(text_config=text, vision_config=vision,
                           image_token_id=tokenizer.convert_tokens_to_ids("<im_patch>"))
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    _write_mtp_layers(model, out_dir / "model.safetensors", num_layers, num_mtp)
    return out_dir


def _write_mtp_layers(model, checkpoint: Path, num_layers: int, num_mtp: int) -> None:
    """Random MTP layers appended to a saved checkpoint under the hub's names:
    `model.layers.<num_layers + k>.{enorm, hnorm, eh_proj, shared_head.norm, <decoder layer>}`."""
    mtp = MtpModel(model, num_mtp)
    with torch.no_grad():
        for name, weight in mtp.named_parameters():
            if name.endswith("norm.weight"):
                weight.normal_(1.0, 0.1)  # norms away from 1, so that a wrong norm would show
    tensors = load_file(checkpoint)
    for name, weight in mtp.state_dict().items():
        if not name.startswith("layers."):
            continue  # embed_tokens and shared_head are the target's
        _, k, rest = name.split(".", 2)
        rest = rest.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
        tensors[f"model.layers.{num_layers + int(k)}.{rest}"] = weight.detach().clone().contiguous()
    save_file(tensors, checkpoint, metadata={"format": "pt"})


_MUSE_GLIMMER_TOKENS = tiny._Tokens(
    bos="<|begin_of_text|>", eos="<|im_end|>", pad="<|pad|>", named={"image_token": "<|patch|>"},
    other=("<|im_start|>", "<|image_start|>", "<|image_end|>", "<|video|>", "<|mask|>"),
)


def _muse_glimmer_processor() -> MuseGlimmerProcessor:
    # 14-pixel patches merged 2 x 2: 2x2 to 3x3 image tokens for tiny_images, at most 16 for any image
    image_processor = MuseGlimmerImageProcessorPil(max_image_tokens=16)
    return _processor(MuseGlimmerProcessor, image_processor, _MUSE_GLIMMER_TOKENS, "<|patch|>")


def _muse_glimmer(out_dir: Path, seed: int) -> Path:
    processor = _muse_glimmer_processor()
    tokenizer = processor.tokenizer
    ids = tokenizer.convert_tokens_to_ids
    text = dict(
        _TEXT, num_hidden_layers=4, initializer_range=tiny.INIT_STD, head_dim=16, vocab_size=len(tokenizer),
        sliding_window=16, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14,
                  pos_emb_height=8, pos_emb_width=8, max_position_embeddings=64, initializer_range=tiny.INIT_STD)
    config = MuseGlimmerConfig(text_config=text, vision_config=vision, image_token_id=ids("<|patch|>"),
                               video_token_id=ids("<|video|>"), out_hidden_size=4 * 32, projector_hidden_size=64)
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


def build_assistant(family: str, out_dir: Path) -> Path:
    """The family's assistant checkpoint: MuseGlimmer's DFlash block drafter, Gemma 4's assistant."""
    builders = {"muse_glimmer": build_dflash_assistant, "gemma4": build_shared_cache_assistant}
    if family not in builders:
        raise ValueError(f"no assistant for {family!r}; families with one: {sorted(builders)}")
    return builders[family](Path(out_dir))


def build_dflash_assistant(out_dir: Path, seed: int = 2) -> Path:
    """MuseGlimmer's DFlash assistant: reads target layers 0 and 2, drafts blocks of 4 (3 tokens)."""
    tokenizer = _muse_glimmer_processor().tokenizer
    config = MuseGlimmerAssistantConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, block_size=4, target_layer_ids=[0, 2], mask_token_id=tokenizer.convert_tokens_to_ids("<|mask|>"),
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        initializer_range=tiny.INIT_STD,
    )
    torch.manual_seed(seed)
    MuseGlimmerAssistantModel(config).save_pretrained(out_dir)
    return Path(out_dir)


_GEMMA4_TOKENS = tiny._Tokens(
    bos="<bos>", eos="<|im_end|>", pad="<pad>",
    # as in Gemma 4's tokenizer_config.json; the processor refuses every input without boa / eoa
    named={"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
           "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"},
    other=("<|im_start|>", "<|video|>"),
)


def _gemma4_processor() -> Gemma4Processor:
    # 4-pixel patches pooled 3 x 3; 70 soft tokens is the smallest budget Gemma 4 supports
    image_processor = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=3)
    return _processor(Gemma4Processor, image_processor, _GEMMA4_TOKENS, "<|image|>", image_seq_length=70)


_GEMMA4_STD = 0.05  # 0.2 collapses greedy output


def _gemma4(out_dir: Path, seed: int) -> Path:
    processor = _gemma4_processor()
    tokenizer = processor.tokenizer
    ids = tokenizer.convert_tokens_to_ids
    text = dict(
        _TEXT, initializer_range=_GEMMA4_STD, head_dim=16, global_head_dim=16, vocab_size=len(tokenizer),
        vocab_size_per_layer_input=len(tokenizer), hidden_size_per_layer_input=8, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=3,
                  position_embedding_size=1024, initializer_range=_GEMMA4_STD)
    config = Gemma4Config(text_config=text, vision_config=vision, audio_config=None, image_token_id=ids("<|image|>"),
                          boi_token_id=ids("<|image>"), eoi_token_id=ids("<image|>"), video_token_id=ids("<|video|>"),
                          initializer_range=_GEMMA4_STD)
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


def build_shared_cache_assistant(out_dir: Path, seed: int = 3) -> Path:
    """Gemma 4's assistant: hidden 32, two layers that attend to the target's shared K/V."""
    tokenizer = _gemma4_processor().tokenizer
    text = dict(
        model_type="gemma4_text", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, global_head_dim=16, vocab_size=len(tokenizer),
        vocab_size_per_layer_input=0, hidden_size_per_layer_input=0, num_kv_shared_layers=2, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], initializer_range=_GEMMA4_STD,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    assistant = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64))
    assistant.generation_config.num_assistant_tokens = 4  # what transformers' own assisted generation drafts
    assistant.save_pretrained(out_dir)
    return Path(out_dir)


# The question the tests of these families ask, with 0, 1 or 2 images, and its answer.
MAX_NEW = 24
IMAGE_COUNTS = (0, 1, 2)


def messages(num_images: int):
    images = tiny.tiny_images(num_images, seed=num_images)
    content = [{"type": "image", "image": image} for image in images]
    return [{"role": "user", "content": content + [{"type": "text", "text": "Describe what you see, then say more."}]}]


def answer(target, num_images, drafter=None, k=4, adaptive=False, draft_tree=0) -> Done:
    engine = Engine(target, {"drafter": drafter} if drafter else {})
    decode = DecodeSettings(max_new_tokens=MAX_NEW, draft_tokens=k, adaptive=adaptive, draft_tree=draft_tree,
                            stop_token_ids=frozenset({-1}))
    done = list(engine.stream(messages(num_images), drafter="drafter" if drafter else None, decode=decode))[-1]
    assert isinstance(done, Done)
    return done


def assert_samples_without_falling_back(target, drafter) -> None:
    """Sampling (rejection sampling against the drafter's own distributions) runs through the
    drafter without a fallback, and equal seeds give equal answers."""
    from engine.sampling import SamplingSettings

    engine = Engine(target, {"drafter": drafter})
    decode = DecodeSettings(max_new_tokens=12, draft_tokens=3, stop_token_ids=frozenset({-1}))
    runs = [list(engine.stream(messages(1), drafter="drafter", decode=decode,
                               sampling=SamplingSettings(temperature=1.0, seed=7)))[-1] for _ in range(2)]
    assert runs[0].stats.fallback_reason is None and runs[0].stats.drafted > 0
    assert runs[0].token_ids == runs[1].token_ids
