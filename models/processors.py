"""Load a vision-language processor, also where torchvision is not installed.

Without torchvision, transformers 5.24 has no video processors, and the image processors of
Step-3.7 and MuseGlimmer exist only as torchvision classes; most others fall back to their
`*Pil` class and work. So without torchvision `load_processor` builds an *image-only*
processor wherever the stock one cannot be built or run:
- classes whose constructor takes a `video_processor` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
  SmolVLM, MuseGlimmer) or also an audio `feature_extractor` (Gemma 4): AutoProcessor fails
  while fetching them (`OSError` / `ImportError`; Gemma 4 without a saved feature extractor:
  `TypeError`), and passing None fails the class check (`AttributeError: ...
  VIDEO_PROCESSOR_MAPPING ... _extra_content`). The image-only processor is a subclass of
  the same class whose constructor has no such arguments, holding the image processor, the
  tokenizer and the chat template;
- a family whose transformers image processor exists only as a torchvision class (Step-3.7,
  MuseGlimmer) passes its own PIL class (`pil_image_processor`, defined in its family file),
  built from the folder's saved settings.
It renders prompts, expands image placeholders and saves exactly like the stock class; only
`videos=` and `audio=` are unsupported.

`placeholder_ids` lists the multimodal placeholder ids a processor inserts for images (and
videos), so that a text-only drafter can drop them and an n-gram drafter never proposes them.
What differs between families (image budgets, the spellings of their placeholders, their
image processors) is in models/families/: this module is the machinery they share.
"""

from __future__ import annotations

import inspect
import logging
import os
import re

from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer
from transformers.image_processing_base import ImageProcessingMixin
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES, processor_class_from_name
from transformers.processing_utils import ProcessorMixin
from transformers.utils import is_torchvision_available

logger = logging.getLogger(__name__)

# Attributes (of a processor or its tokenizer) that name a multimodal placeholder token,
# e.g. image_token, video_token, boi_token, eoi_token, fake_image_token, global_image_tag,
# vision_start_token. Counts such as num_image_tokens do not end in _token / _tag.
_PLACEHOLDER_ATTRIBUTE = re.compile(r"\w*(image|img|video|vision|boi|eoi)\w*_(token|tag)")


def load_processor(path_or_id: str, trust_remote_code: bool = False, pil_image_processor: type | None = None
                   ) -> ProcessorMixin:
    """The multimodal processor saved in `path_or_id` (a folder or a hub id).

    `AutoProcessor`, or without torchvision an image-only processor of the same class where the
    stock one needs torchvision (see above); `pil_image_processor`: the family's PIL image
    processor class where transformers has only a torchvision one. Raises ValueError, saying
    what to do, when the folder holds no multimodal processor.
    """
    processor_class = _builtin_processor_class(path_or_id)
    try:
        if processor_class is not None and _needs_image_only(processor_class, pil_image_processor, path_or_id):
            logger.info("%s: %s without video / audio processors, PIL images", path_or_id, processor_class.__name__)
            processor = _load_image_only(processor_class, path_or_id, pil_image_processor)
        else:
            processor = AutoProcessor.from_pretrained(path_or_id, trust_remote_code=trust_remote_code)
    except OSError as err:  # a file is missing
        raise _no_processor_error(path_or_id, f"{type(err).__name__}: {err}") from err
    except ValueError as err:  # AutoProcessor: "Unrecognized processing class in ..."
        raise _no_processor_error(path_or_id, str(err)) from err

    if not isinstance(processor, ProcessorMixin) or not hasattr(processor, "image_processor"):
        raise _no_processor_error(path_or_id, f"found only a {type(processor).__name__}")
    return processor


def build_image_only_processor(
    processor_class: type[ProcessorMixin], image_processor, tokenizer, **kwargs
) -> ProcessorMixin:
    """An instance of `processor_class` built from an image processor and a tokenizer only.

    For classes whose constructor wants a video processor (Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
    SmolVLM, MuseGlimmer) or an audio feature extractor too (Gemma 4); `kwargs` are the class's
    own options (chat_template, image_seq_len, ...). The instance's class keeps the stock
    class name, so `save_pretrained` writes an ordinary checkpoint that `load_processor` (and,
    with torchvision, `AutoProcessor`) reads back.
    """
    dropped = _video_and_audio_attributes(processor_class)
    if not dropped:
        return processor_class(image_processor=image_processor, tokenizer=tokenizer, **kwargs)

    def __init__(self, image_processor, tokenizer, **kwargs):
        processor_class.__init__(
            self, image_processor=image_processor, tokenizer=tokenizer, **dict.fromkeys(dropped), **kwargs
        )

    # ProcessorMixin reads this signature to list the sub-processors and the options that
    # save_pretrained writes (image_seq_len, ...): the stock one without the dropped ones.
    stock = inspect.signature(processor_class.__init__)
    parameters = [parameter for parameter in stock.parameters.values() if parameter.name not in dropped]
    __init__.__signature__ = stock.replace(parameters=parameters)

    def apply_chat_template(self, conversation, chat_template=None, **kwargs):
        # SmolVLM's override only adds frame-sampling defaults read from its video processor;
        # without videos the base method renders the same prompt.
        return ProcessorMixin.apply_chat_template(self, conversation, chat_template, **kwargs)

    image_only_class = type(
        processor_class.__name__,
        (processor_class, _WithoutAbsentSubProcessors),
        {
            "__init__": __init__,
            "apply_chat_template": apply_chat_template,
            "__doc__": f"{processor_class.__name__} without {' or '.join(dropped)}.",
        },
    )
    return image_only_class(image_processor=image_processor, tokenizer=tokenizer, **kwargs)


class _WithoutAbsentSubProcessors(ProcessorMixin):
    """Comes between a stock processor class and ProcessorMixin in an image-only class's method
    order: the stock constructor's `super().__init__(..., video_processor=None)` lands here, and
    sub-processors that are None and not in the image-only signature are not passed on (a
    positional None beyond the signature's sub-processors is already ignored by ProcessorMixin)."""

    def __init__(self, *args, **kwargs):
        attributes = self.get_attributes()
        super().__init__(*args, **{key: value for key, value in kwargs.items()
                                   if value is not None or key in attributes or key == "chat_template"})


def placeholder_ids(processor: ProcessorMixin, spellings: re.Pattern) -> set[int]:
    """Ids of every multimodal placeholder or marker token the processor inserts: the tokens the
    processor and its tokenizer name (image_token, boi_token, ...), plus the tokenizer's added
    tokens that fully match `spellings` (the family's markup that no attribute names, e.g.
    Qwen's <|vision_start|>, SmolVLM's <row_1_col_2>). Only tokens in the vocabulary count.
    """
    tokenizer = processor.tokenizer
    vocab = tokenizer.get_vocab()
    named = {**tokenizer.special_tokens_map, **vars(processor)}
    tokens = {
        str(value)
        for name, value in named.items()
        if _PLACEHOLDER_ATTRIBUTE.fullmatch(name) and isinstance(value, str)
    }
    tokens |= {token for token in tokenizer.get_added_vocab() if spellings.fullmatch(token)}
    return {vocab[token] for token in tokens if token in vocab}


def _load_image_only(processor_class: type[ProcessorMixin], path_or_id: str, pil_image_processor: type | None
                     ) -> ProcessorMixin:
    """`processor_class` loaded from `path_or_id` without its video and audio processors."""
    processor_dict, _ = processor_class.get_processor_dict(path_or_id)  # holds the chat template
    parameters = inspect.signature(processor_class.__init__).parameters
    attributes = processor_class.get_attributes()
    options = {
        key: value for key, value in processor_dict.items() if key in parameters and key not in attributes
    }
    return build_image_only_processor(
        processor_class,
        image_processor=_load_image_processor(path_or_id, pil_image_processor),
        tokenizer=AutoTokenizer.from_pretrained(path_or_id),
        **options,
    )


def _load_image_processor(path_or_id: str, pil_image_processor: type | None):
    """The folder's image processor: the family's PIL class where transformers has only a
    torchvision one, else AutoImageProcessor's (its `*Pil` class without torchvision)."""
    if pil_image_processor is None:
        return AutoImageProcessor.from_pretrained(path_or_id)
    settings, _ = ImageProcessingMixin.get_image_processor_dict(path_or_id)
    return pil_image_processor.from_dict(settings)


def _needs_image_only(processor_class: type[ProcessorMixin], pil_image_processor: type | None,
                      path_or_id: str) -> bool:
    """Without torchvision: `processor_class` wants video / audio processors, or the family's
    image processor exists only as a torchvision class. With torchvision: a local folder saved
    image-only (`build_image_only_processor`: no video / audio processor settings in it, as the
    bundled demos are), which AutoProcessor would refuse for the missing video processor."""
    wanted = _video_and_audio_attributes(processor_class)
    if not is_torchvision_available():
        return pil_image_processor is not None or bool(wanted)
    return bool(wanted) and os.path.isdir(path_or_id) and not _saved_with(path_or_id, wanted)


def _saved_with(folder: str, attributes: list[str]) -> bool:
    """Whether `folder` holds settings for any of the sub-processors `attributes` (in its
    processor_config.json, or a file of their own, or the older shared preprocessor_config.json)."""
    own_files = ("video_preprocessor_config.json", "preprocessor_config.json", "feature_extractor_config.json")
    if any(os.path.isfile(os.path.join(folder, name)) for name in own_files):
        return True
    processor_dict, _ = ProcessorMixin.get_processor_dict(folder)
    return any(name in processor_dict for name in attributes)


def _video_and_audio_attributes(processor_class: type[ProcessorMixin]) -> list[str]:
    """The sub-processors an image-only `processor_class` goes without: video_processor,
    feature_extractor (audio), ..."""
    return [name for name in processor_class.get_attributes()
            if any(modality in name for modality in ("video", "audio", "feature_extractor"))]


def _builtin_processor_class(path_or_id: str) -> type[ProcessorMixin] | None:
    """The transformers processor class saved for `path_or_id`, else its model type's; None if unknown."""
    try:
        name = ProcessorMixin.get_processor_dict(path_or_id)[0].get("processor_class")
        if name is None:
            name = PROCESSOR_MAPPING_NAMES.get(AutoConfig.from_pretrained(path_or_id).model_type)
    except (OSError, ValueError):
        return None
    return processor_class_from_name(name) if isinstance(name, str) else None


def _no_processor_error(path_or_id: str, reason: str) -> ValueError:
    return ValueError(
        f"No usable multimodal processor in {path_or_id!r} ({reason}). A vision-language model "
        "needs its processor files next to the weights: preprocessor_config.json or "
        "processor_config.json, the tokenizer files and a chat template. Copy them from the "
        "original checkpoint, or save them with `processor.save_pretrained(folder)`."
    )
