"""Tokenizer, chat template and image-only processor of the bundled demo models.

The tokenizer is a byte-level BPE trained on the demo world's own text, with the Qwen2-VL
special tokens. The processor is `Qwen2VLProcessor` less its video processor: transformers cannot build a
video processor here without torchvision (the stock constructor type-checks its `None` video
processor and fails), and the demo world has no videos.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoImageProcessor, PreTrainedTokenizerFast, Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from models.demo.world import IMAGE_SIZE

SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
)

# Qwen2-VL's template with two changes: no default system message (one is written only when
# the conversation starts with it), and "Picture N: " before each image unless the caller
# passes add_vision_id=False (Qwen2-VL writes it only on add_vision_id=True). The demo models
# were trained with the numbers: they tell which picture is "the second image".
# One message's content: a string, or text parts and "Picture N: " + vision markers per image
# (models/demo/smol.py's template renders contents the same way).
CONTENT_TEMPLATE = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id is not defined or add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
)
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    + CONTENT_TEMPLATE +
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """`Qwen2VLProcessor` with an image processor and a tokenizer only."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = tokenizer.image_token
        self.video_token = tokenizer.video_token
        self.image_token_id = tokenizer.image_token_id
        self.video_token_id = tokenizer.video_token_id
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def build_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts` (deterministic for the same texts)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>",
        },
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def build_processor(tokenizer: PreTrainedTokenizerFast) -> ImageOnlyQwen2VLProcessor:
    """Image processor sized to the world's 84 x 84 pictures (9 tokens each); larger uploads
    are scaled down to at most 84 * 84 pixels."""
    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=IMAGE_SIZE * IMAGE_SIZE)
    return ImageOnlyQwen2VLProcessor(image_processor, tokenizer, chat_template=CHAT_TEMPLATE)


def load_processor(path: str) -> ImageOnlyQwen2VLProcessor:
    """Load the image-only processor that `build_processor(...).save_pretrained(path)` wrote."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    image_processor = AutoImageProcessor.from_pretrained(path)
    return ImageOnlyQwen2VLProcessor(image_processor, tokenizer, chat_template=tokenizer.chat_template)
