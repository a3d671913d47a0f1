"""A chat turn made ready for the models: rendered, tokenized, images processed.

Messages follow the transformers chat format, with PIL images in the content:
    [{"role": "system", "content": [{"type": "text", "text": "..."}]},
     {"role": "user", "content": [{"type": "image", "image": <PIL.Image>}, {"type": "text", "text": "..."}]},
     {"role": "assistant", "content": [{"type": "text", "text": "..."}]}, ...]
A plain string is accepted as the content of a text-only message.

Text that spells a token the tokenizer adds whole (`<|im_end|>`, `<|image_pad|>`, `<image>`...)
is broken up by `neutralize` so that it tokenizes as plain text: typed text never forges a
chat turn or becomes an image placeholder.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
from PIL import Image


@dataclass
class Prompt:
    messages: list[dict]
    images: list[Image.Image]
    target_inputs: dict[str, torch.Tensor]  # processor outputs; input_ids (1, S)
    placeholder_ids: frozenset[int]  # image placeholder / marker ids of the target's family
    max_image_tokens: int | None = None  # the budget each image was processed with (None: the processor's own)

    @functools.cached_property
    def input_ids(self) -> list[int]:
        """The prompt's ids, read from the tensor once per Prompt (shared: do not modify)."""
        return self.target_inputs["input_ids"][0].tolist()

    @functools.cached_property
    def num_image_tokens(self) -> int:
        return sum(token in self.placeholder_ids for token in self.input_ids)


def normalize(messages: list[dict]) -> list[dict]:
    """Content as a list of parts; string content becomes one text part."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        out.append({"role": message["role"], "content": list(content)})
    return out


BREAK = "\u200b"  # zero-width space: put inside a special token's spelling, it tokenizes as text


def neutralize(messages: list[dict], tokenizer) -> list[dict]:
    """Normalized `messages` with every spelling of the tokenizer's markup tokens in their text
    broken by BREAK after its first character: "<|im_end|>" becomes "<" BREAK "|im_end|>"."""
    pattern = _markup_pattern(tokenizer)
    if pattern is None:
        return messages
    return [{"role": m["role"], "content": [
        {**part, "text": pattern.sub(lambda match: match[0][0] + BREAK + match[0][1:], part["text"])}
        if part["type"] == "text" else part for part in m["content"]]} for m in messages]


@functools.lru_cache(maxsize=16)
def _markup_pattern(tokenizer) -> re.Pattern | None:
    """The added tokens that are markup (a letter or digit and a symbol, e.g. <|im_start|>,
    <image>, [INST], <row_1_col_1>), longest first; None if the tokenizer has none."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    spellings = {token.content for token in added
                 if re.search(r"[^\W_]", token.content) and re.search(r"[^\w\s]", token.content)}
    if not spellings:
        return None
    return re.compile("|".join(re.escape(text) for text in sorted(spellings, key=len, reverse=True)))


def images_of(messages: list[dict]) -> list[Image.Image]:
    return [part["image"] for m in messages for part in m["content"] if part["type"] == "image"]


def text_only(messages: list[dict]) -> list[dict]:
    """The conversation as a text-only LM sees it: image parts removed, content as a plain
    string (what text-only chat templates expect)."""
    return [
        {"role": m["role"], "content": "\n".join(p["text"] for p in m["content"] if p["type"] == "text")}
        for m in messages
    ]


def render(processor_or_tokenizer, messages: list[dict]) -> str:
    """The chat template applied, with the generation prompt; images appear as the template's
    placeholder parts (the `image` key is dropped so templates never serialize pixels)."""
    template_messages = [
        {"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
         [{"type": "text", "text": p["text"]} if p["type"] == "text" else {"type": p["type"]} for p in m["content"]]}
        for m in messages
    ]
    return processor_or_tokenizer.apply_chat_template(template_messages, tokenize=False, add_generation_prompt=True)


def encode_vlm(processor, family, messages: list[dict], max_image_tokens: int | None = None) -> dict[str, torch.Tensor]:
    """Processor outputs for a VLM of `family`: input_ids (1, S), attention_mask, pixel values,
    grids...; each image at most about `max_image_tokens` tokens (Family.image_budget)."""
    text = render(processor, messages)
    images = images_of(messages)
    budget = family.image_budget(processor, max_image_tokens) if images else {}
    inputs = processor(text=[text], images=images or None, return_tensors="pt", **budget)
    return {name: value for name, value in inputs.items() if isinstance(value, torch.Tensor)}


def encode_text(tokenizer, messages: list[dict]) -> dict[str, torch.Tensor]:
    """Tokenizer outputs for a text-only LM on the text-only view of the conversation."""
    text = render(tokenizer, text_only(messages))
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return {"input_ids": ids}
